"""The one interface every generation engine implements, and the results it returns.

An engine turns one prompt into `n` completions. It is async because generation fans out: many
prompts are in flight at once on one event loop. An engine never blocks that loop: network I/O is
awaited, CPU/GPU work (tokenising, `model.generate`) runs in a worker thread. An engine retries what
is worth retrying (a 5xx, a timeout, a request aborted by a weight update) with bounded backoff, within
the group's one `Deadline` when it takes one, and raises `EngineError` when it gives up; the producer
then publishes the group as failed.

The contract is explicit: an engine has `Engine`'s ``name``, ``start``, ``generate`` and ``close``, and
declares what it does beyond them in ``capabilities`` (an `EngineCapabilities`). The producer reads that
declaration (`capabilities_of`, which checks the methods each capability needs are there) and never
inspects signatures or classes: it passes the group's deadline, checks sampling options, lends its user
threads and hands announced weights exactly as declared.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
from rollstream.infra.threads import ThreadPool
from rollstream.schemas import FINISH_REASONS, ConfigError, RollstreamError, VersionSpan

DEFAULT_REQUEST_TIMEOUT_S = 600.0  # one request of an HTTP engine may legitimately take minutes


class EngineError(RollstreamError):
    """Generation failed. ``retriable`` says whether the producer may try the prompt again."""


@dataclass(frozen=True)
class Completion:
    """One generated response.

    Attributes:
        text: the decoded response.
        tokens: response token ids (not the prompt's).
        logprobs: one log-probability per response token under the generating policy, or None.
        finish_reason: ``stop`` (end of sequence or a stop string), ``length`` (max_new_tokens) or
            ``abort`` (the engine gave up on the request, e.g. during a weight update).
        policy_version: the policy version the engine reports for this response, if it knows one (the
            ``weight_version`` of a custom generate function's dict and of SGLang's ``meta_info``: the newest).
        loss_mask: one 0/1 per response token (0: a tool or environment token, not trained), or None (all 1).
        version_spans: which policy version generated which response tokens, oldest first, back to back
            (SGLang's ``meta_info.weight_versions``; a continued partial rollout has several), or empty.
        resume_points: the response token indices where generation resumed from an in-flight checkpoint
            (another producer's, killed mid-generation), ascending, each in 0..len(tokens); empty when none.
        resumed_from: for each resume point, the id of the producer whose checkpoint was continued.
    """

    text: str
    tokens: Sequence[int] | np.ndarray
    logprobs: Sequence[float] | np.ndarray | None = None
    finish_reason: str = "stop"
    policy_version: int | None = None
    loss_mask: Sequence[int] | np.ndarray | None = None
    version_spans: Sequence[VersionSpan] = ()
    resume_points: Sequence[int] = ()
    resumed_from: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise EngineError(f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise EngineError(f"completion has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs")
        if len(self.resume_points) or len(self.resumed_from):  # most completions never resumed
            self._check_resumes()

    def _check_resumes(self) -> None:
        points, n = list(self.resume_points), len(self.tokens)
        if len(points) != len(self.resumed_from):
            raise EngineError(f"completion has {len(points)} resume points but {len(self.resumed_from)} producer "
                              "ids they resumed from: give one per resume point")
        if not all(isinstance(p, int | np.integer) and not isinstance(p, bool) for p in points):
            raise EngineError(f"resume points {points} must be integer token indices")
        if points[0] < 0 or points[-1] > n or points != sorted(points):
            raise EngineError(f"resume points {points} must be ascending token indices in 0..{n} (the completion "
                              f"has {n} tokens)")
        if not all(isinstance(r, str) for r in self.resumed_from):
            raise EngineError(f"resumed_from {list(self.resumed_from)!r} must be producer ids (strings)")

    def to_dict(self) -> dict[str, Any]:
        """The dict a reward function receives, in the completion-dict contract's names: text, tokens,
        logprobs (lists), finish_reason, weight_version (the policy version), loss_mask (0/1 per token, or
        None), weight_versions (the version spans as ``{"version", "start", "end"}`` dicts; [] when none),
        resume_points and resumed_from (lists; [] when generation never resumed from a checkpoint)."""
        return {"text": self.text, "tokens": np.asarray(self.tokens).tolist(),
                "logprobs": None if self.logprobs is None else np.asarray(self.logprobs, dtype=float).tolist(),
                "finish_reason": self.finish_reason, "weight_version": self.policy_version,
                "loss_mask": None if self.loss_mask is None else np.asarray(self.loss_mask).astype(int).tolist(),
                "weight_versions": [{"version": s.version, "start": s.start, "end": s.end}
                                    for s in self.version_spans],
                "resume_points": [int(p) for p in self.resume_points], "resumed_from": list(self.resumed_from)}


@dataclass(frozen=True)
class Generation:
    """What an engine returns for one prompt: the prompt as sent, and its completions."""

    completions: Sequence[Completion]
    prompt_text: str = ""
    prompt_tokens: Sequence[int] = field(default_factory=tuple)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings handed to every engine (SGLang's names; `extra` passes anything else through)."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    top_k: int = -1  # -1: off

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise EngineError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        object.__setattr__(self, "extra", dict(self.extra))

    def to_dict(self) -> dict[str, Any]:
        """The dict form (a fresh copy): SGLang's ``sampling_params``, and a custom generate's argument."""
        top_k = {} if self.top_k == -1 else {"top_k": self.top_k}
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                "top_p": self.top_p, **top_k, **self.extra}


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine declares it does beyond `Engine`'s methods. The producer reads it, as declared:

    Attributes:
        takes_deadline: its ``generate`` (and ``generate_tokens``, where it has one) takes the keyword
            ``deadline: Deadline | None = None``; the producer passes the group's deadline, which the
            engine's own retries spend and never outlast (the producer bounds every call by it anyway).
        checks_sampling: it has ``check_sampling(sampling)``, raising ConfigError for a sampling option it
            has no name for; the producer calls it before `Engine.start` (`ChecksSampling`).
        runs_user_code: it runs plug-in code (a generate function, an environment) and has
            ``use_threads(pool)``; the producer lends it its ``rollstream-user`` threads before
            `Engine.start`, so that code never runs on the event loop (`RunsUserCode`).
        reloads_weights: it owns its weights: ``policy_version`` and ``reload`` (`ReloadableEngine`); the
            producer hands it each announced version that names weights.
        saves_progress: its ``generate`` takes the keyword ``progress: Progress | None = None``
            (`rollstream.producers.engines.progress`): it resumes samples from their checkpoints and saves
            their state as it goes; the producer passes the group's `Progress` when checkpoints are on.
    """

    takes_deadline: bool = False
    checks_sampling: bool = False
    runs_user_code: bool = False
    reloads_weights: bool = False
    saves_progress: bool = False


# the members each capability needs, beyond `Engine`'s
_NEEDS: dict[str, tuple[str, ...]] = {"checks_sampling": ("check_sampling",), "runs_user_code": ("use_threads",),
                                      "reloads_weights": ("policy_version", "reload")}
_WRITE_YOUR_OWN = 'docs/engines.md, "Write your own engine"'


@runtime_checkable
class Engine(Protocol):
    """A generation backend. `start` and `close` bracket its use; both are idempotent. ``capabilities``
    (a class attribute, usually) declares what else it does; see `EngineCapabilities`."""

    name: str
    capabilities: EngineCapabilities

    async def start(self) -> None:
        """Load what the engine needs (model, tokenizer, HTTP client). Never blocks the loop."""

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        """Generate `n` completions for `prompt` (a `Prompt.plugin_dict()`: id, prompt, label, metadata, epoch,
        attempt).

        An engine that retries on its own should also take a keyword ``deadline: Deadline | None = None``
        (as the HTTP engines do) and declare ``takes_deadline``: the producer then passes the group's
        `Deadline`, which its retries spend and never outlast. The producer bounds every call by it anyway.
        Raises:
            EngineError: generation failed after the engine's own retries.
        """
        ...

    async def close(self) -> None:
        """Release clients, threads and models."""


@runtime_checkable
class ReloadableEngine(Protocol):
    """An engine that owns its weights and can swap in a new policy version while it serves.

    The producer calls `reload` for each announcement on NS.control it follows that names a
    ``weights_path`` (only the latest pending one, one call at a time). It decides what to load: a new
    trainer run may announce a lower number than the one serving, or the same number with other weights.
    Engines whose weights the trainer updates itself (SGLang servers, through SGLang's own weight-update
    API) do not implement it: they only stamp versions.
    """

    @property
    def policy_version(self) -> int | None:
        """The policy version of the weights serving now (None when unknown)."""

    async def reload(self, weights_path: str, version: int) -> bool:
        """Load `weights_path` as `version` without blocking the loop; keep serving the old weights until
        the new ones are in. Load whatever the number (lower or equal to the one serving too: the caller
        skips what is served already). Returns True when the weights were loaded.

        Raises:
            EngineError: the weights could not be loaded (the old ones keep serving).
        """
        ...


class ChecksSampling(Protocol):
    """The method ``EngineCapabilities.checks_sampling`` declares."""

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raise ConfigError for a sampling option this engine has no name for. No I/O."""


class RunsUserCode(Protocol):
    """The method ``EngineCapabilities.runs_user_code`` declares."""

    def use_threads(self, threads: ThreadPool) -> None:
        """Run plug-in code in `threads` (the producer's ``rollstream-user``, which it owns and closes)."""


def capabilities_of(engine: object) -> EngineCapabilities:
    """The capabilities `engine` declares, checked against the members they need. No I/O.

    Raises:
        ConfigError: `engine` declares none (no `EngineCapabilities` as its ``capabilities``), lacks one of
            `Engine`'s methods, or lacks a member a declared capability needs; the message names what to add.
    """
    where = f"engine {getattr(engine, 'name', None) or type(engine).__qualname__!r} ({type(engine).__qualname__})"
    declared = getattr(engine, "capabilities", None)
    if not isinstance(declared, EngineCapabilities):
        raise ConfigError(f"{where} declares no capabilities: give its class `capabilities = EngineCapabilities(...)` "
                          "(rollstream.producers.engines.base), saying which of takes_deadline, checks_sampling, "
                          f"runs_user_code, reloads_weights it has ({_WRITE_YOUR_OWN})")
    missing = [m for m in ("name", "start", "generate", "close") if inspect.getattr_static(engine, m, None) is None]
    for flag, members in _NEEDS.items():
        absent = [m for m in members if getattr(declared, flag) and inspect.getattr_static(engine, m, None) is None]
        missing += [f"{', '.join(absent)} (it declares {flag})"] if absent else []
    if missing:
        raise ConfigError(f"{where} has no {', '.join(missing)}; add it, or leave the capability out "
                          f"({_WRITE_YOUR_OWN})")
    return declared


def prepare(engine: Engine, *, threads: ThreadPool, sampling: SamplingParams) -> EngineCapabilities:
    """What the producer does with `engine` before `Engine.start`, as it declares: lend it `threads`
    (``runs_user_code``), check `sampling` (``checks_sampling``). No I/O; returns the capabilities.

    Raises:
        ConfigError: the engine's declaration does not hold (`capabilities_of`), or it has no name for a
            sampling option.
    """
    declared = capabilities_of(engine)
    if declared.runs_user_code:
        cast(RunsUserCode, engine).use_threads(threads)
    if declared.checks_sampling:  # an option the engine has no name for: refused before anything runs
        cast(ChecksSampling, engine).check_sampling(sampling)
    return declared
