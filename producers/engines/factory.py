"""Build an engine from `EngineSettings` (`build_engine`), or from the ``rollstream produce`` flags as keywords
(`make_engine`); the CLI stays a thin parser."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rollstream.producers.engines._samples import PartialRollouts
from rollstream.producers.engines.base import DEFAULT_REQUEST_TIMEOUT_S, Engine, SamplingParams
from rollstream.producers.engines.custom import CustomEngine
from rollstream.producers.engines.environment import EnvironmentEngine, load_environment
from rollstream.producers.engines.hf import HFEngine
from rollstream.producers.engines.options import (
    EngineKind,
    EngineSettings,
    EnvironmentOptions,
    HTTPEngineOptions,
    SGLangOptions,
    VLLMOptions,
)
from rollstream.producers.engines.sglang_engine import SGLangEngine
from rollstream.producers.engines.sglang_http import SGLangHTTPEngine, SGLangSyncEngine
from rollstream.producers.engines.vllm_http import LogprobsMode, VLLMHTTPEngine, VLLMSyncEngine
from rollstream.producers.multiturn import DEFAULT_MAX_TURNS
from rollstream.schemas import ConfigError

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
    """The engine the ``rollstream produce`` flags describe, each flag a keyword: grouped per engine into
    `EngineSettings` (`rollstream.producers.engines.options`) and built by `build_engine`. No I/O.

    Raises:
        ConfigError: ``--max-turns`` without ``--environment``, an option out of range, or what `build_engine`
            raises.
    """
    if environment is None and max_turns is not None:
        raise ConfigError("--max-turns bounds the episodes of --environment MODULE:CLASS; give an environment "
                          "or leave --max-turns out")
    episodes = None if environment is None else EnvironmentOptions(
        environment, DEFAULT_MAX_TURNS if max_turns is None else max_turns)
    return build_engine(EngineSettings(
        kind, model=model, tokenizer=tokenizer, generate=generate,
        http=HTTPEngineOptions(request_timeout_s=request_timeout_s, partial_rollouts=partial_rollouts),
        sglang=SGLangOptions(urls=tuple(sglang_urls), sync_weights=sglang_sync_weights),
        vllm=VLLMOptions(urls=tuple(vllm_urls), served_model=vllm_model, logprobs_mode=vllm_logprobs_mode,
                         sync_weights=vllm_sync_weights),
        environment=episodes), sampling=sampling)


def build_engine(settings: EngineSettings, *, sampling: SamplingParams | None = None) -> Engine:
    """The engine `settings` describe. No I/O (the engine loads in its `start`; an environment's module is
    imported here).

    - ``environment``: the engine the other settings describe is the policy of multi-turn episodes
      (`EnvironmentEngine`). Needs ``vllm``, ``sglang`` or ``hf``, and a tokenizer for an HTTP engine.
    - ``generate``: a custom generate function ``MODULE:FUNC`` (no ``kind``).
    - ``sglang`` with ``sglang.urls``: SGLang over HTTP; `tokenizer` (default `model`) makes it send token
      ids with the chat template applied, else the server tokenizes the text. The trainer updates the
      servers' weights, unless ``sglang.sync_weights``: then the producer does (`SGLangSyncEngine`).
    - ``sglang`` with ``model`` and no URL: SGLang in-process (``sglang.Engine``, GPU); it loads announced
      weights itself.
    - ``vllm`` with ``vllm.urls``: vLLM's OpenAI-compatible server over HTTP; `tokenizer` as for SGLang;
      ``vllm.logprobs_mode`` (the servers' ``--logprobs-mode``) checked against `sampling` when given. The
      trainer updates their weights, unless ``vllm.sync_weights``: then the producer does (`VLLMSyncEngine`).
    - ``hf`` with ``model``: transformers on CPU.
    ``http.partial_rollouts`` (SGLang, vLLM): ``continue`` a sample aborted by a weight update, or ``restart`` it.
    Raises:
        ConfigError: a contradictory or incomplete combination (the message lists the valid ones, in flag
            names), a ``--generate`` or ``--environment`` path that does not import, a `sampling` option the
            engine has no name for, or (vLLM) `sampling` whose logprobs the servers' ``--logprobs-mode``
            cannot give as rollstream records them.
    """
    _check_environment(settings)
    engine = _policy_engine(settings, sampling)
    episodes = settings.environment
    if episodes is None:
        return engine
    return EnvironmentEngine(engine, load_environment(episodes.spec), max_turns=episodes.max_turns,
                             label=f"--environment {episodes.spec}")


def _check_environment(settings: EngineSettings) -> None:
    """ConfigError for an environment with settings it does not go with (see `build_engine`)."""
    if settings.environment is None:
        return
    if settings.generate is not None:
        raise ConfigError("--environment plays episodes with an engine as the policy and --generate replaces the "
                          "engine: give --environment with --engine vllm|sglang|hf, or play the episodes inside "
                          "your generate function (rollstream.producers.multiturn.run_episodes)")
    if settings.kind is None:
        raise ConfigError(f"--environment needs an engine as the policy; {_ENVIRONMENT_USAGE}")
    if not (settings.tokenizer or settings.model) and (settings.sglang.urls or settings.vllm.urls):
        raise ConfigError(f"--environment with --engine {settings.kind} needs --tokenizer DIR (the served model's "
                          "tokenizer): an episode sends token ids, the prompt's and each turn's, and the environment "
                          "encodes its replies with it")


def _policy_engine(settings: EngineSettings, sampling: SamplingParams | None) -> Engine:
    """The engine of `build_engine`'s settings but ``environment`` (see there)."""
    kind, sglang, vllm, http, model = settings.kind, settings.sglang, settings.vllm, settings.http, settings.model
    served_tokenizer = settings.tokenizer or model  # an HTTP engine's: the served model's
    if sglang.sync_weights and not (kind == "sglang" and sglang.urls):
        raise ConfigError("--sglang-sync-weights is for --engine sglang --sglang-url URL (the producer updates "
                          "those servers); in-process SGLang and --engine hf load announced weights anyway")
    if vllm.sync_weights and not (kind == "vllm" and vllm.urls):
        raise ConfigError("--vllm-sync-weights is for --engine vllm --vllm-url URL (the producer updates those "
                          "servers' weights)")
    if vllm.urls and kind != "vllm":
        raise ConfigError(f"--vllm-url is for --engine vllm; {_USAGE}")
    if settings.generate is not None:
        if kind is not None or sglang.urls:
            raise ConfigError(f"--generate replaces --engine/--sglang-url; {_USAGE}")
        return CustomEngine.from_spec(settings.generate)
    if kind == "vllm":
        if sglang.urls:
            raise ConfigError("--sglang-url is for --engine sglang; give vLLM servers as --vllm-url URL")
        if not vllm.urls:
            raise ConfigError(f"--engine vllm needs --vllm-url URL (a `vllm serve` server); {_USAGE}")
        served = VLLMSyncEngine if vllm.sync_weights else VLLMHTTPEngine
        return served(list(vllm.urls), model=vllm.served_model, tokenizer=served_tokenizer,
                      timeout_s=http.request_timeout_s, logprobs_mode=vllm.logprobs_mode,
                      partial_rollouts=http.partial_rollouts, sampling=sampling)
    if kind == "sglang":
        if sglang.urls:
            server = SGLangSyncEngine if sglang.sync_weights else SGLangHTTPEngine
            return server(list(sglang.urls), tokenizer=served_tokenizer, timeout_s=http.request_timeout_s,
                          partial_rollouts=http.partial_rollouts, sampling=sampling)
        if model is not None:
            return SGLangEngine(model, tokenizer=settings.tokenizer, partial_rollouts=http.partial_rollouts,
                                sampling=sampling)
        raise ConfigError(f"--engine sglang needs --sglang-url URL (a server or router), or --model DIR to run "
                          f"SGLang in-process; {_USAGE}")
    if kind == "hf":
        if sglang.urls:
            raise ConfigError("--sglang-url is for --engine sglang")
        if model is None:
            raise ConfigError("--engine hf needs --model DIR (e.g. one made by rollstream.producers.build_tiny_model)")
        return HFEngine(model)
    if kind is None:
        raise ConfigError(f"no engine given; {_USAGE}")
    raise ConfigError(f"unknown engine {kind!r}; {_USAGE}")
