"""Choose and build an engine from the ``rollstream produce`` flags (the CLI stays a thin parser)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from rollstream.producers.engines._samples import PartialRollouts
from rollstream.producers.engines.base import DEFAULT_REQUEST_TIMEOUT_S, Engine, SamplingParams
from rollstream.producers.engines.custom import CustomEngine
from rollstream.producers.engines.environment import EnvironmentEngine, load_environment
from rollstream.producers.engines.hf import HFEngine
from rollstream.producers.engines.sglang_engine import SGLangEngine
from rollstream.producers.engines.sglang_http import SGLangHTTPEngine, SGLangSyncEngine
from rollstream.producers.engines.vllm_http import LogprobsMode, VLLMHTTPEngine, VLLMSyncEngine
from rollstream.producers.multiturn import DEFAULT_MAX_TURNS
from rollstream.schemas import ConfigError

EngineKind = Literal["sglang", "hf", "vllm"]
_ENVIRONMENT_USAGE = ("--engine vllm --vllm-url URL --tokenizer DIR, --engine sglang --sglang-url URL --tokenizer DIR, "
                      "or --engine hf --model DIR")
_USAGE = ("choose one of: --engine sglang --sglang-url URL, --engine vllm --vllm-url URL, --engine hf --model DIR, "
          "or --generate MODULE:FUNC")


def make_engine(kind: EngineKind | None = None, *, sglang_urls: Sequence[str] = (), model: Path | str | None = None,
                tokenizer: Path | str | None = None, generate: str | None = None,
                request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S, partial_rollouts: PartialRollouts = "continue",
                sglang_sync_weights: bool = False, vllm_urls: Sequence[str] = (), vllm_model: str | None = None,
                vllm_logprobs_mode: LogprobsMode = "processed_logprobs", sampling: SamplingParams | None = None,
                environment: str | None = None, max_turns: int | None = None, vllm_sync_weights: bool = False
                ) -> Engine:
    """The engine the flags describe. No I/O (the engine loads in its `start`; an environment's module is
    imported here).

    - ``environment``: ``MODULE:CLASS`` of an environment class; the engine the other flags describe is then
      the policy of multi-turn episodes (`EnvironmentEngine`), each at most `max_turns` policy turns
      (default `DEFAULT_MAX_TURNS`). Needs ``vllm``, ``sglang`` or ``hf``, and a tokenizer for an HTTP engine.
    - ``generate``: a custom generate function ``MODULE:FUNC`` (no ``kind``).
    - ``sglang`` + ``sglang_urls``: SGLang over HTTP; `tokenizer` (default `model`) makes it send token
      ids with the chat template applied, else the server tokenizes the text. The trainer updates the
      servers' weights, unless `sglang_sync_weights`: then the producer does (`SGLangSyncEngine`).
    - ``sglang`` + ``model`` and no URL: SGLang in-process (``sglang.Engine``, GPU); it loads announced
      weights itself.
    - ``vllm`` + ``vllm_urls``: vLLM's OpenAI-compatible server over HTTP; `tokenizer` (default `model`) as
      for SGLang; `vllm_model` the served model name (default: the server's); `vllm_logprobs_mode` the
      servers' ``--logprobs-mode``, checked against the producer's `sampling` when given. The trainer
      updates their weights, unless `vllm_sync_weights`: then the producer does (`VLLMSyncEngine`).
    - ``hf`` + ``model``: transformers on CPU.
    `partial_rollouts` (SGLang, vLLM): ``continue`` a sample aborted by a weight update, or ``restart`` it.
    Raises:
        ConfigError: a contradictory or incomplete combination (the message lists the valid ones), a
            ``--generate`` path that does not import, a `sampling` option the engine has no name for, or
            (vLLM) `sampling` whose logprobs the servers' ``--logprobs-mode`` cannot give as rollstream
            records them.
    """
    _check_environment(kind, environment, max_turns, generate=generate,
                       tokenized=bool(tokenizer or model) or not (sglang_urls or vllm_urls))
    engine = _policy_engine(kind, sglang_urls=sglang_urls, model=model, tokenizer=tokenizer, generate=generate,
                            request_timeout_s=request_timeout_s, partial_rollouts=partial_rollouts,
                            sglang_sync_weights=sglang_sync_weights, vllm_urls=vllm_urls, vllm_model=vllm_model,
                            vllm_logprobs_mode=vllm_logprobs_mode, sampling=sampling,
                            vllm_sync_weights=vllm_sync_weights)
    if environment is None:
        return engine
    return EnvironmentEngine(engine, load_environment(environment),
                             max_turns=DEFAULT_MAX_TURNS if max_turns is None else max_turns,
                             label=f"--environment {environment}")


def _check_environment(kind: EngineKind | None, environment: str | None, max_turns: int | None, *,
                       generate: str | None, tokenized: bool) -> None:
    """ConfigError for ``--environment`` / ``--max-turns`` flags that do not go together (see `make_engine`)."""
    if environment is None:
        if max_turns is not None:
            raise ConfigError("--max-turns bounds the episodes of --environment MODULE:CLASS; give an environment "
                              "or leave --max-turns out")
        return
    if generate is not None:
        raise ConfigError("--environment plays episodes with an engine as the policy and --generate replaces the "
                          "engine: give --environment with --engine vllm|sglang|hf, or play the episodes inside "
                          "your generate function (rollstream.producers.multiturn.run_episodes)")
    if kind is None:
        raise ConfigError(f"--environment needs an engine as the policy; {_ENVIRONMENT_USAGE}")
    if not tokenized:
        raise ConfigError(f"--environment with --engine {kind} needs --tokenizer DIR (the served model's tokenizer): "
                          "an episode sends token ids, the prompt's and each turn's, and the environment encodes its "
                          "replies with it")


def _policy_engine(kind: EngineKind | None, *, sglang_urls: Sequence[str], model: Path | str | None,
                   tokenizer: Path | str | None, generate: str | None, request_timeout_s: float,
                   partial_rollouts: PartialRollouts, sglang_sync_weights: bool, vllm_urls: Sequence[str],
                   vllm_model: str | None, vllm_logprobs_mode: LogprobsMode, sampling: SamplingParams | None,
                   vllm_sync_weights: bool) -> Engine:
    """The engine of `make_engine`'s flags but ``environment`` (see there)."""
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
