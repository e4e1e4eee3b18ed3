"""`EngineSettings`: which engine a producer generates with, and each engine's own options, grouped per engine.

The ``rollstream produce`` engine flags map one to one: ``--engine``, ``--model``, ``--tokenizer`` and
``--generate`` are the engine's choice; ``--sglang-url`` and ``--sglang-sync-weights`` are `SGLangOptions`;
``--vllm-url``, ``--vllm-model``, ``--vllm-logprobs-mode`` and ``--vllm-sync-weights`` `VLLMOptions`;
``--request-timeout`` and ``--partial-rollouts``, which the SGLang and vLLM engines share, `HTTPEngineOptions`;
``--environment`` and ``--max-turns`` `EnvironmentOptions`. `rollstream.producers.engines.factory` checks how
they combine and builds the engine; `ProducerSettings` holds none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollstream.producers.engines._samples import PARTIAL_ROLLOUTS, PartialRollouts
from rollstream.producers.engines._vllm_format import LogprobsMode
from rollstream.producers.engines.base import DEFAULT_REQUEST_TIMEOUT_S
from rollstream.producers.multiturn import DEFAULT_MAX_TURNS
from rollstream.schemas import ConfigError

EngineKind = Literal["sglang", "hf", "vllm"]


@dataclass(frozen=True)
class HTTPEngineOptions:
    """What the SGLang and vLLM engines share (validated here, before any engine is made).

    Attributes:
        request_timeout_s: one HTTP request at most (cut to what is left of the group's deadline).
        partial_rollouts: a sample a weight update aborted is continued on the new weights from prompt +
            partial output (``continue``), or generated again (``restart``); in-process SGLang too.
    """

    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    partial_rollouts: PartialRollouts = "continue"

    def __post_init__(self) -> None:
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s={self.request_timeout_s} must be > 0")
        if self.partial_rollouts not in PARTIAL_ROLLOUTS:
            raise ConfigError(f"partial_rollouts={self.partial_rollouts!r}: use continue or restart")


@dataclass(frozen=True)
class SGLangOptions:
    """SGLang's own options. `urls`: servers or an sglang-router (none, with a model: SGLang in-process);
    `sync_weights`: the producer updates those servers to each announced version (`SGLangSyncEngine`)."""

    urls: tuple[str, ...] = ()
    sync_weights: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(self.urls))


@dataclass(frozen=True)
class VLLMOptions:
    """vLLM's own options. `urls`: `vllm serve` servers; `served_model`: the model name they serve (None:
    the server's); `logprobs_mode`: their ``--logprobs-mode``; `sync_weights`: the producer updates their
    weights to each announced version (`VLLMSyncEngine`)."""

    urls: tuple[str, ...] = ()
    served_model: str | None = None
    logprobs_mode: LogprobsMode = "processed_logprobs"
    sync_weights: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(self.urls))


@dataclass(frozen=True)
class EnvironmentOptions:
    """Multi-turn episodes on the engine: `spec` is the environment's ``MODULE:CLASS``, `max_turns` the
    policy turns of an episode at most."""

    spec: str
    max_turns: int = DEFAULT_MAX_TURNS


@dataclass(frozen=True)
class EngineSettings:
    """The engine to build (`rollstream.producers.engines.factory.build_engine`) and its options.

    Attributes:
        kind: ``sglang``, ``vllm`` or ``hf``; None with `generate`.
        model: the model directory (``hf``, in-process SGLang; the default tokenizer of the HTTP engines).
        tokenizer: the served model's tokenizer: the HTTP engines send token ids with it.
        generate: a custom generate function's ``MODULE:FUNC`` (no `kind`).
        http, sglang, vllm: each engine's own options (`HTTPEngineOptions`, `SGLangOptions`, `VLLMOptions`).
        environment: multi-turn episodes with `kind`'s engine as the policy, or None.
    """

    kind: EngineKind | None = None
    model: Path | str | None = None
    tokenizer: Path | str | None = None
    generate: str | None = None
    http: HTTPEngineOptions = field(default_factory=HTTPEngineOptions)
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    environment: EnvironmentOptions | None = None
