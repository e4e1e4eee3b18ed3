"""A user's generate function as an engine (``--generate MODULE:FUNC``).

The function is ``async def f(prompt: dict, n: int, sampling_params: dict) -> list[dict]`` returning `n`
completion dicts. Each dict has (docs/engines.md, "Custom generate"):

- ``text`` (str) and ``tokens`` (list[int]): the response, without the prompt;
- ``logprobs`` (list[float], optional): one per response token under the generating policy; it may hold
  0.0 where ``loss_mask`` is 0 (tokens the policy did not generate have no logprob);
- ``finish_reason``: ``stop`` | ``length`` | ``abort``;
- ``loss_mask`` (list of 0/1, optional): one per response token, 0 for tool or environment tokens of a
  multi-turn rollout (they are not trained); absent: every token is the policy's;
- ``weight_version`` (int, optional): the policy version that generated the response (the newest one);
- ``weight_versions`` (optional): spans ``{"version": int, "start": int, "end": int}`` over the response
  tokens, oldest first, back to back from 0 to ``len(tokens)`` (a response continued on newer weights has
  several); with both, ``weight_version`` must be the last span's version;
- ``prompt_tokens`` (list[int], optional) and ``prompt_text`` (str, optional): the prompt as the policy saw
  it, the same in every dict of one call; the trainer's rows are ``prompt_tokens + tokens``.

`rollstream.producers.multiturn` builds such dicts for multi-turn rollouts. MODULE:FUNC may also name a class: it
is instantiated without arguments and its instances are the generate function (``async __call__``); an
instance's ``start()`` and ``close()``, when it has them, bracket the producer's run (for a generate
function that owns a model or a client); async ones are awaited, sync ones run in a thread of their own,
never on the event loop. An instance that has ``reload(weights_path, version)``
(async, or sync: run in the user threads) owns its weights: the engine then declares ``reloads_weights``,
and the producer hands it each announced version that names weights, as it does the built-in engines
(`ReloadableEngine`); its ``policy_version`` attribute, when it has one, is the version it serves. A plain
(sync) function is accepted too and runs in the
producer's ``rollstream-user`` threads (`use_threads`; without them, a few of the engine's own) so it
cannot block the event loop, and a hung call holds only its own thread. A result with
``finish_reason=abort`` raises a retriable `EngineError`: the producer retries the prompt (within the
group's deadline) rather than ship an aborted sample. A malformed result
raises a non-retriable `EngineError` naming the completion, the field and the lengths.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
from rollstream.infra.threads import ThreadPool, in_thread
from rollstream.producers._plugins import load_callable
from rollstream.producers.engines.base import (
    Completion,
    Engine,
    EngineCapabilities,
    EngineError,
    Generation,
    SamplingParams,
    capabilities_of,
)
from rollstream.schemas import ConfigError, InvalidRecordError, Sample, VersionSpan

_OWN_THREADS = 4  # a sync function's threads when the producer lends none (the engine used on its own)


class CustomEngine:
    """Wraps a generate function. Stateless apart from the function; safe to share across prompts. It runs
    user code (``runs_user_code``), and ``reloads_weights`` when the generate object has ``reload``."""

    name = "custom"

    def __init__(self, fn: Callable[..., Any], *, label: str | None = None) -> None:
        self._fn = fn
        self._label: str = label or str(getattr(fn, "__qualname__", type(fn).__qualname__))
        # An instance with ``async def __call__`` is async too (iscoroutinefunction says no to the instance).
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        self._threads: ThreadPool | None = None  # the producer's user threads, lent by `use_threads`
        self._own: ThreadPool | None = None  # made on first need without them; closed by `close`
        reloads = not inspect.isfunction(fn) and callable(getattr(fn, "reload", None))
        self.capabilities = EngineCapabilities(runs_user_code=True, reloads_weights=reloads)

    def use_threads(self, threads: ThreadPool) -> None:
        """Run a sync generate function in `threads` (the producer's ``rollstream-user``, which it owns)."""
        self._threads = threads

    @classmethod
    def from_spec(cls, spec: str) -> CustomEngine:
        """Build from ``MODULE:FUNC`` (or ``MODULE:CLASS``, instantiated without arguments).

        Raises:
            ConfigError: the module or function is missing, or the class cannot be instantiated.
        """
        target = load_callable(spec, "--generate")
        if not inspect.isclass(target):
            return cls(target, label=spec)
        try:
            instance = target()
        except Exception as exc:
            raise ConfigError(f"--generate {spec!r}: {target.__name__}() raised {type(exc).__name__}: {exc}") from exc
        if not callable(instance):
            raise ConfigError(f"--generate {spec!r}: {target.__name__} instances are not callable; give the class "
                              "an async __call__(prompt, n, sampling_params)")
        return cls(instance, label=spec)

    async def start(self) -> None:
        """Await the generate object's own ``start()`` if it has one. Raises what it raises."""
        await self._lifecycle("start")

    async def close(self) -> None:
        """Await the generate object's own ``close()`` if it has one; let the engine's own threads end."""
        try:
            await self._lifecycle("close")
        finally:
            if self._own is not None:
                own, self._own = self._own, None
                if self._threads is own:
                    self._threads = None
                own.close()

    async def _lifecycle(self, method: str) -> None:
        """The generate object's own `method` hook, when it has one: awaited when async; a sync one runs in
        a thread of its own (``rollstream-user-start`` / ``-close``), never on the loop, and never queued
        behind generate calls that hang in the user threads. A coroutine it returns is awaited."""
        hook = None if inspect.isfunction(self._fn) else getattr(self._fn, method, None)
        if not callable(hook):
            return
        if inspect.iscoroutinefunction(hook):
            await hook()
            return
        result = await in_thread(hook, name=f"rollstream-user-{method}")
        if inspect.isawaitable(result):
            await result

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` awaited, or run in the user threads when it is sync (a coroutine it returns awaited)."""
        if inspect.iscoroutinefunction(fn) or (fn is self._fn and self._is_async):
            return await fn(*args)
        if self._threads is None:
            self._threads = self._own = ThreadPool("rollstream-user", _OWN_THREADS)
        result = await self._threads.run(fn, *args)
        return await result if inspect.isawaitable(result) else result

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """Call the function once for `n` completions and validate what it returns.

        Raises:
            EngineError: the function raised (retriable), returned something malformed (not retriable),
                or returned an aborted completion (retriable).
        """
        args = (dict(prompt), n, sampling.to_dict())
        try:
            result = await self._call(self._fn, *args)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"{self._label} raised {type(exc).__name__}: {exc}", retriable=True) from exc
        completions = self._validate(result, n)
        if any(c.finish_reason == "abort" for c in completions):
            raise EngineError(f"{self._label} returned an aborted completion", retriable=True)
        prompt_text, prompt_tokens = _prompt_of(result, self._label)
        return Generation(completions=completions, prompt_text=prompt_text, prompt_tokens=prompt_tokens)

    def _validate(self, result: Any, n: int) -> list[Completion]:
        if not isinstance(result, list | tuple):
            raise EngineError(f"{self._label} must return a list of dicts, got {type(result).__name__}",
                              retriable=False)
        if len(result) != n:
            raise EngineError(f"{self._label} returned {len(result)} completions, expected n={n}", retriable=False)
        return [completion_from_dict(item, self._label, i) for i, item in enumerate(result)]

    @property
    def policy_version(self) -> int | None:
        """The generate object's ``policy_version`` when it is an int, else None (unknown)."""
        version = getattr(self._fn, "policy_version", None)
        return version if isinstance(version, int) and not isinstance(version, bool) else None

    async def reload(self, weights_path: str, version: int) -> bool:
        """Call the generate object's ``reload(weights_path, version)``; True unless it returns False. Only
        with ``reloads_weights`` (the producer calls it only then).

        Raises:
            EngineError: it raised (the old weights keep serving, as far as rollstream knows), or it has no
                ``reload``.
        """
        try:
            result = await self._call(self._fn.reload, weights_path, version)  # type: ignore[attr-defined]
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"{self._label}.reload({weights_path!r}, {version}) raised {type(exc).__name__}: "
                              f"{exc}", retriable=True) from exc
        return result is not False


def as_engine(engine: Engine | Callable[..., Any]) -> Engine:
    """`engine` itself when it is an engine (it has ``generate``), its declared capabilities checked; else a
    generate function (or object) wrapped in a `CustomEngine`. No I/O.

    Raises:
        ConfigError: an engine whose declaration does not hold (`capabilities_of` says what to add), or
            something that is neither an engine nor callable.
    """
    if inspect.getattr_static(engine, "generate", None) is not None:
        capabilities_of(engine)
        return cast(Engine, engine)
    if not callable(engine):
        raise ConfigError(f"{engine!r} is neither an engine (name, capabilities, start, generate, close) nor a "
                          "generate function (async def f(prompt, n, sampling_params) -> list[dict])")
    return CustomEngine(engine)


def completion_from_dict(item: Any, label: str, index: int) -> Completion:
    """Validate one completion dict of the custom-generate contract (errors name the field and lengths).

    ``tokens``, ``logprobs`` and ``loss_mask`` may be lists or 1-D numpy arrays (checked vectorised, not
    per element). Raises EngineError (not retriable).
    """
    if not isinstance(item, Mapping):
        raise EngineError(f"{_where(label, index)}: expected a dict, got {type(item).__name__}", retriable=False)
    text = item.get("text", "")
    if not isinstance(text, str):
        raise EngineError(f"{_where(label, index)}: 'text' must be a string", retriable=False)
    tokens = _array(item.get("tokens"), "iu", label, index, "'tokens' must be a list of ints")
    logprobs = item.get("logprobs")
    if logprobs is not None:
        logprobs = _array(logprobs, "iuf", label, index, "'logprobs' must be a list of floats or absent")
    mask = item.get("loss_mask")
    if mask is not None:
        mask = _array(mask, "iub", label, index, "'loss_mask' must be a list of 0/1 ints or absent")
    version = item.get("weight_version")
    if version is not None:
        version = _int_or_none(version, f"{_where(label, index)}: 'weight_version' must be an int or absent")
    spans = _spans(item.get("weight_versions"), _where(label, index)) if "weight_versions" in item else ()
    if spans and version is not None and version != spans[-1].version:
        raise EngineError(f"{_where(label, index)}: 'weight_version' {version} is not the newest of "
                          f"'weight_versions' ({spans[-1].version}); give the newest, or leave it out",
                          retriable=False)
    if mask is not None or spans:
        _check_against_tokens(tokens, mask, spans, _where(label, index))
    try:
        return Completion(text=text, tokens=tokens, logprobs=logprobs,
                          finish_reason=item.get("finish_reason", "stop"),
                          policy_version=spans[-1].version if spans else version, loss_mask=mask,
                          version_spans=spans, resume_points=tuple(item.get("resume_points", ())),
                          resumed_from=tuple(item.get("resumed_from", ())))
    except EngineError as exc:
        raise EngineError(f"{_where(label, index)}: {exc}", retriable=False) from exc


def _where(label: str, index: int) -> str:
    """How errors name a completion (built only when one is raised: most completions are fine)."""
    return f"{label} completion {index}"


def _check_against_tokens(tokens: np.ndarray, mask: np.ndarray | None, spans: tuple[VersionSpan, ...],
                          where: str) -> None:
    """The mask and the spans checked as the record will check them (`Sample` states the rules once)."""
    try:
        if mask is not None:
            Sample(tokens=tokens, loss_mask=mask)
    except InvalidRecordError as exc:
        raise EngineError(f"{where}: {exc}", retriable=False) from exc
    try:
        if spans:
            Sample(tokens=tokens, version_spans=spans)
    except InvalidRecordError as exc:
        raise EngineError(f"{where}: 'weight_versions': {exc}", retriable=False) from exc


def _spans(value: Any, where: str) -> tuple[VersionSpan, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise EngineError(f"{where}: 'weight_versions' must be a list of {{\"version\", \"start\", \"end\"}} "
                          f"dicts, got {type(value).__name__}", retriable=False)
    spans = tuple(_span(span, f"{where}: 'weight_versions' entry {i}") for i, span in enumerate(value))
    versions = [s.version for s in spans]
    if versions != sorted(versions):
        raise EngineError(f"{where}: 'weight_versions' must be oldest first, got versions {versions}",
                          retriable=False)
    return spans


def _span(span: Any, where: str) -> VersionSpan:
    message = f"{where} must be a dict of int 'version', 'start', 'end', got {span!r}"
    if not isinstance(span, Mapping):
        raise EngineError(message, retriable=False)
    version, start, end = (_int_or_none(span.get(k), message) for k in ("version", "start", "end"))
    if version is None or start is None or end is None:
        raise EngineError(message, retriable=False)
    try:
        return VersionSpan(version, start, end)
    except InvalidRecordError as exc:
        raise EngineError(f"{where}: {exc}", retriable=False) from exc


def _prompt_of(items: Sequence[Mapping[str, Any]], label: str) -> tuple[str, tuple[int, ...]]:
    """The ``prompt_text`` and ``prompt_tokens`` the dicts carry (the same in each), or ("", ())."""
    if not any("prompt_text" in item or "prompt_tokens" in item for item in items):
        return "", ()
    texts, token_lists = set(), set()
    for i, item in enumerate(items):
        text = item.get("prompt_text", "")
        if not isinstance(text, str):
            raise EngineError(f"{label} completion {i}: 'prompt_text' must be a string or absent", retriable=False)
        tokens = _array(item.get("prompt_tokens", ()), "iu", label, i,
                        "'prompt_tokens' must be a list of ints or absent")
        texts.add(text)
        token_lists.add(tuple(tokens.tolist()))
    if len(texts) > 1 or len(token_lists) > 1:
        raise EngineError(f"{label}: the completions of one call carry {len(texts)} different 'prompt_text' and "
                          f"{len(token_lists)} different 'prompt_tokens'; they share one prompt: give the same "
                          "in each, or leave them out", retriable=False)
    return next(iter(texts), ""), next(iter(token_lists), ())


def _int_or_none(value: Any, message: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise EngineError(message, retriable=False)
    return int(value)


def _array(values: Any, kinds: str, label: str, index: int, problem: str) -> np.ndarray:
    """`values` as a 1-D array of one of numpy's `kinds`; else EngineError: "<completion>: <problem>"."""
    if type(values) is np.ndarray:  # what a fast generate function returns: nothing to convert
        array = values
    elif not isinstance(values, list | tuple | np.ndarray):
        raise EngineError(f"{_where(label, index)}: {problem}", retriable=False)
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise EngineError(f"{_where(label, index)}: {problem}", retriable=False) from exc
    if array.ndim != 1 or (array.size and array.dtype.kind not in kinds):
        raise EngineError(f"{_where(label, index)}: {problem}", retriable=False)
    return array
