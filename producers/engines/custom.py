"""A user's generate function as an engine (``--generate MODULE:FUNC``).

The function is ``async def f(prompt: dict, n: int, sampling_params: dict) -> list[dict]`` (DESIGN.md):
each dict has ``text``, ``tokens`` (list[int]), optional ``logprobs`` (list[float]), ``finish_reason``
(stop | length | abort) and optional ``weight_version`` (int). A plain (sync) function is accepted too
and runs in a worker thread so it cannot block the event loop. A result with ``finish_reason=abort``
raises a retriable `EngineError`: the producer retries the prompt rather than ship an aborted sample.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from producers._plugins import load_callable
from producers.engines.base import Completion, EngineError, Generation, SamplingParams


class CustomEngine:
    """Wraps a generate function. Stateless apart from the function; safe to share across prompts."""

    name = "custom"

    def __init__(self, fn: Callable[..., Any], *, label: str | None = None) -> None:
        self._fn = fn
        self._label: str = label or str(getattr(fn, "__qualname__", repr(fn)))
        self._is_async = inspect.iscoroutinefunction(fn)

    @classmethod
    def from_spec(cls, spec: str) -> CustomEngine:
        """Build from ``MODULE:FUNC``. Raises ConfigError when the module or function is missing."""
        return cls(load_callable(spec, "--generate"), label=spec)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """Call the function once for `n` completions and validate what it returns.

        Raises:
            EngineError: the function raised (retriable), returned something malformed (not retriable),
                or returned an aborted completion (retriable).
        """
        args = (dict(prompt), n, sampling.to_dict())
        try:
            if self._is_async:
                result = await self._fn(*args)
            else:
                result = await asyncio.to_thread(self._fn, *args)
                if inspect.isawaitable(result):
                    result = await result
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"{self._label} raised {type(exc).__name__}: {exc}", retriable=True) from exc
        completions = self._validate(result, n)
        if any(c.finish_reason == "abort" for c in completions):
            raise EngineError(f"{self._label} returned an aborted completion", retriable=True)
        return Generation(completions=completions)

    def _validate(self, result: Any, n: int) -> list[Completion]:
        if not isinstance(result, list | tuple):
            raise EngineError(f"{self._label} must return a list of dicts, got {type(result).__name__}",
                              retriable=False)
        if len(result) != n:
            raise EngineError(f"{self._label} returned {len(result)} completions, expected n={n}", retriable=False)
        return [completion_from_dict(item, self._label, i) for i, item in enumerate(result)]


def completion_from_dict(item: Any, label: str, index: int) -> Completion:
    """Validate one completion dict of the custom-generate contract (errors name the field).

    ``tokens`` and ``logprobs`` may be lists or 1-D numpy arrays (checked vectorised, not per element).
    """
    where = f"{label} completion {index}"
    if not isinstance(item, Mapping):
        raise EngineError(f"{where}: expected a dict, got {type(item).__name__}", retriable=False)
    text = item.get("text", "")
    if not isinstance(text, str):
        raise EngineError(f"{where}: 'text' must be a string", retriable=False)
    tokens = _array(item.get("tokens"), "iu", f"{where}: 'tokens' must be a list of ints")
    logprobs = item.get("logprobs")
    if logprobs is not None:
        logprobs = _array(logprobs, "iuf", f"{where}: 'logprobs' must be a list of floats or absent")
    version = item.get("weight_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise EngineError(f"{where}: 'weight_version' must be an int or absent", retriable=False)
    try:
        return Completion(text=text, tokens=tokens, logprobs=logprobs,
                          finish_reason=item.get("finish_reason", "stop"), policy_version=version)
    except EngineError as exc:
        raise EngineError(f"{where}: {exc}", retriable=False) from exc


def _array(values: Any, kinds: str, message: str) -> np.ndarray:
    if not isinstance(values, list | tuple | np.ndarray):
        raise EngineError(message, retriable=False)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise EngineError(message, retriable=False) from exc
    if array.ndim != 1 or (array.size and array.dtype.kind not in kinds):
        raise EngineError(message, retriable=False)
    return array
