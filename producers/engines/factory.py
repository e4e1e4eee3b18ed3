"""Choose and build an engine from the ``rollstream produce`` flags (the CLI stays a thin parser)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from rollstream.producers.engines._samples import PartialRollouts
from rollstream.producers.engines.base import DEFAULT_REQUEST_TIMEOUT_S, Engine, SamplingParams
from rollstream.producers.engines.custom import CustomEngine
from rollstream.producers.engines.hf import HFEngine
from rollstream.producers.engines.sglang_engine import SGLangEngine
from rollstream.producers.engines.sglang_http import SGLangHTTPEngine, SGLangSyncEngine
from rollstream.producers.engines.vllm_http import LogprobsMode, VLLMHTTPEngine, VLLMSyncEngine
from rollstream.schemas import ConfigError

EngineKind = Literal["sglang", "hf", "vllm"]
_USAGE = ("choose one of: --engine sglang --sglang-url URL, --engine vllm --vllm-url URL, --engine hf --model DIR, "
          "or --generate MODULE:FUNC")


def make_engine(kind: EngineKind | None = None, *, sglang_urls: Sequence[str] = (), model: Path | str | None = None,
                tokenizer: Path | str | None = None, generate: str | None = None,
                request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, partial_rollouts: PartialRollouts = "continue",
                sglang_sync_weights: bool = False, vllm_urls: Sequence[str] = (), vllm_model: str | None = None,
                vllm_logprobs_mode: LogprobsMode = "processed_logprobs", sampling: SamplingParams | None = None,
                vllm_sync_weights: bool = False) -> Engine:
    """The engine the flags describe. No I/O (the engine loads in its `start`).

    - ``generate``: a custom generate function ``MODULE:FUNC`` (no ``kind``).
    - ``sglang`` + ``sglang_urls``: SGLang over HTTP; `tokenizer` (default `model`) makes it send token
      ids with the chat template applied, else the server tokenizes the text. The trainer updates the
      servers' weights, unless `sglang_sync_weights`: then the producer does (`SGLangSyncEngine`).
    - ``sglang`` + ``model`` and no URL: SGLang in-process (``sglang.Engine``, GPU); it loads announced
      weights itself.
    - ``vllm`` + ``vllm_urls``: vLLM's OpenAI-compatible server over HTTP; `tokenizer` (default `model`) as
      for SGLang; `vllm_model` the served model name (default: the server's); `vllm_logprobs_mode` the
      servers' ``--logprobs-mode``, checked against the producer's `sampling` when given. The trainer
      updates their weights; aborted samples are restarted.
    - ``hf`` + ``model``: transformers on CPU.
    `partial_rollouts` (SGLang): ``continue`` a sample aborted by a weight update, or ``restart`` it.
    Raises:
        ConfigError: a contradictory or incomplete combination (the message lists the valid ones), a
            ``--generate`` path that does not import, a `sampling` option the engine has no name for, or
            (vLLM) `sampling` whose logprobs the servers' ``--logprobs-mode`` cannot give as rollstream
            records them.
    """
    if sglang_sync_weights and not (kind == "sglang" and sglang_urls):
        raise ConfigError("--sglang-sync-weights is for --engine sglang --sglang-url URL (the producer updates "
                          "those servers); in-process SGLang and --engine hf load announced weights anyway")
    if vllm_sync_weights and not (kind == "vllm" and vllm_urls):
        raise ConfigError("--vllm-sync-weights is for --engine vllm --vllm-url URL (the producer updates those "
                          "servers' weights)")
    if vllm_urls and kind != "vllm":
        raise ConfigError(f"--vllm-url is for --engine vllm; {_USAGE}")
    if generate is not None:
        if kind is not None or sglang_urls:
            raise ConfigError(f"--generate replaces --engine/--sglang-url; {_USAGE}")
        return CustomEngine.from_spec(generate)
    if kind == "vllm":
        if sglang_urls:
            raise ConfigError("--sglang-url is for --engine sglang; give vLLM servers as --vllm-url URL")
        if not vllm_urls:
            raise ConfigError(f"--engine vllm needs --vllm-url URL (a `vllm serve` server); {_USAGE}")
        vllm = VLLMSyncEngine if vllm_sync_weights else VLLMHTTPEngine
        return vllm(list(vllm_urls), model=vllm_model, tokenizer=tokenizer or model, timeout_s=request_timeout_s,
                    logprobs_mode=vllm_logprobs_mode, partial_rollouts=partial_rollouts, sampling=sampling)
    if kind == "sglang":
        if sglang_urls:
            http = SGLangSyncEngine if sglang_sync_weights else SGLangHTTPEngine
            return http(list(sglang_urls), tokenizer=tokenizer or model, timeout_s=request_timeout_s,
                        partial_rollouts=partial_rollouts, sampling=sampling)
        if model is not None:
            return SGLangEngine(model, tokenizer=tokenizer, partial_rollouts=partial_rollouts, sampling=sampling)
        raise ConfigError(f"--engine sglang needs --sglang-url URL (a server or router), or --model DIR to run "
                          f"SGLang in-process; {_USAGE}")
    if kind == "hf":
        if sglang_urls:
            raise ConfigError("--sglang-url is for --engine sglang")
        if model is None:
            raise ConfigError("--engine hf needs --model DIR (e.g. one made by rollstream.producers.build_tiny_model)")
        return HFEngine(model)
    if kind is None:
        raise ConfigError(f"no engine given; {_USAGE}")
    raise ConfigError(f"unknown engine {kind!r}; {_USAGE}")
