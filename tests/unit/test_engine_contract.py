"""The engine contract (`rollstream.producers.engines.base`; issue 36, item 4), without a broker.

Pinned here:

1. a third-party engine gets exactly what its `EngineCapabilities` declare, never what its signatures or
   class suggest: the group's deadline (``takes_deadline``), the sampling check (``checks_sampling``), the
   producer's user threads (``runs_user_code``) and announced weights (``reloads_weights``); an engine that
   has every method but declares nothing gets none of them;
2. an engine that declares no capabilities, or declares one without the member it needs, is a one-line
   ConfigError from the producer (and from `EnvironmentEngine`, which wraps it) saying what to add;
3. every built-in engine declares its capabilities, and a custom generate object declares ``reloads_weights``
   exactly when it has ``reload``: one `CustomEngine` class, no class swapped in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest
from rollstream.infra import KafkaConfig
from rollstream.infra.threads import ThreadPool
from rollstream.producers import (
    Completion,
    CustomEngine,
    Deadline,
    EngineCapabilities,
    EnvironmentEngine,
    Generation,
    RolloutProducer,
    SamplingParams,
    make_engine,
)
from rollstream.producers._pipeline import GroupPipeline, GroupSettings
from rollstream.producers.engines.base import capabilities_of, prepare
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.schemas import ConfigError, PolicyVersion

PROMPT = {"id": "p0", "prompt": "q", "label": None, "metadata": {}, "epoch": 0, "attempt": 0}
SAMPLING = SamplingParams(max_new_tokens=4)
EVERYTHING = EngineCapabilities(takes_deadline=True, checks_sampling=True, runs_user_code=True, reloads_weights=True)


class _ThirdParty:
    """Has every optional member and records each call; declares only what it is built with."""

    name = "third-party"

    def __init__(self, capabilities: EngineCapabilities) -> None:
        self.capabilities = capabilities
        self.deadlines: list[Deadline | None] = []
        self.checked: list[SamplingParams] = []
        self.threads: list[ThreadPool] = []
        self.reloads: list[int] = []
        self.policy_version: int | None = 0

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams, *,
                       deadline: Deadline | None = None) -> Generation:
        self.deadlines.append(deadline)
        return Generation(completions=[Completion(text="a", tokens=[1])] * n)

    def check_sampling(self, sampling: SamplingParams) -> None:
        self.checked.append(sampling)

    def use_threads(self, threads: ThreadPool) -> None:
        self.threads.append(threads)

    async def reload(self, weights_path: str, version: int) -> bool:
        self.reloads.append(version)
        self.policy_version = version
        return True


def _serve(engine: _ThirdParty) -> None:
    """What the producer does with an engine: prepare it, generate one group, follow one announcement."""
    metrics = ProducerMetrics()
    threads = ThreadPool("rollstream-user", 1)

    async def go() -> None:
        prepare(engine, threads=threads, sampling=SAMPLING)
        follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False)
        await follower.start(catch_up_timeout=0)
        try:
            pipeline = GroupPipeline(
                GroupSettings(n_samples=2, sampling=SAMPLING, attempts=1, max_attempts=1, backoff_s=0.0,
                              timeout_s=30.0, producer_id="p", prompts_topic="t.prompts", max_message_bytes=1 << 20),
                engine=engine, reward=None, metrics=metrics, publisher=None, gate=None,  # type: ignore[arg-type]
                policy=follower)
            await pipeline.generate(dict(PROMPT))
            follower.on_announced(PolicyVersion(3, weights_path="/ckpt/v3"))
            for _ in range(200):  # the follower loads in a task of its own
                if engine.reloads or not engine.capabilities.reloads_weights:
                    break
                await asyncio.sleep(0.005)
        finally:
            await follower.close()
            threads.close()

    asyncio.run(go())


@pytest.mark.parametrize("declared", [EVERYTHING, EngineCapabilities(), EngineCapabilities(takes_deadline=True),
                                      EngineCapabilities(checks_sampling=True, reloads_weights=True)],
                         ids=["everything", "nothing", "deadline", "sampling+weights"])
def test_a_third_party_engine_gets_exactly_what_it_declares(declared: EngineCapabilities) -> None:
    engine = _ThirdParty(declared)
    _serve(engine)
    assert len(engine.deadlines) == 1
    assert isinstance(engine.deadlines[0], Deadline) if declared.takes_deadline else engine.deadlines == [None]
    assert engine.checked == ([SAMPLING] if declared.checks_sampling else [])
    assert len(engine.threads) == (1 if declared.runs_user_code else 0)
    assert engine.reloads == ([3] if declared.reloads_weights else [])


class _Undeclared:
    """An engine written before the contract: the methods, no declaration."""

    name = "old"

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt: Mapping[str, Any], n: int, sampling: SamplingParams) -> Generation:
        return Generation(completions=[Completion(text="a", tokens=[1])] * n)


class _ClaimsWeights(_Undeclared):
    capabilities = EngineCapabilities(reloads_weights=True)


def test_an_engine_that_declares_nothing_is_a_config_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError) as caught:
        RolloutProducer(_Undeclared())  # type: ignore[arg-type]
    message = str(caught.value)
    assert message.startswith("engine 'old' (_Undeclared) declares no capabilities: give its class "
                              "`capabilities = EngineCapabilities(...)`") and "\n" not in message
    assert 'docs/engines.md, "Write your own engine"' in message
    with pytest.raises(ConfigError, match="declares no capabilities"):
        EnvironmentEngine(_Undeclared(), object)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"engine 'old' \(_ClaimsWeights\) has no policy_version, reload "
                                          r"\(it declares reloads_weights\); add it, or leave the capability out"):
        RolloutProducer(_ClaimsWeights())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="neither an engine .* nor a generate function"):
        RolloutProducer(42)  # type: ignore[arg-type]


def test_built_in_engines_and_custom_generate_declare_their_capabilities() -> None:
    http = {"takes_deadline": True, "checks_sampling": True}
    cases = {make_engine("vllm", vllm_urls=["h:1"]): EngineCapabilities(**http, saves_progress=True),
             make_engine("vllm", vllm_urls=["h:1"], vllm_sync_weights=True): EngineCapabilities(
                 **http, reloads_weights=True, saves_progress=True),
             make_engine("sglang", sglang_urls=["h:1"]): EngineCapabilities(**http, saves_progress=True),
             make_engine("sglang", sglang_urls=["h:1"], sglang_sync_weights=True): EngineCapabilities(
                 **http, reloads_weights=True, saves_progress=True),
             make_engine("sglang", model="/m"): EngineCapabilities(checks_sampling=True, reloads_weights=True,
                                                                   saves_progress=True),
             make_engine("hf", model="/m"): EngineCapabilities(reloads_weights=True),
             make_engine(generate="tests.plugins:instant"): EngineCapabilities(runs_user_code=True)}
    for engine, declared in cases.items():
        assert capabilities_of(engine) == declared, engine.name

    class Agent:
        async def __call__(self, prompt: dict, n: int, sampling_params: dict) -> list[dict]:
            return []

        def reload(self, weights_path: str, version: int) -> None: ...

    agent = CustomEngine(Agent())
    assert type(agent) is CustomEngine and agent.capabilities == EngineCapabilities(runs_user_code=True,
                                                                                    reloads_weights=True)


def test_engine_options_are_grouped_per_engine_and_build_what_the_flags_build() -> None:
    from rollstream.producers.engines import (
        EngineSettings,
        HTTPEngineOptions,
        SGLangOptions,
        VLLMOptions,
        VLLMSyncEngine,
        build_engine,
    )

    settings = EngineSettings("vllm", vllm=VLLMOptions(urls=["h:1"], sync_weights=True),  # type: ignore[arg-type]
                              http=HTTPEngineOptions(request_timeout_s=5.0, partial_rollouts="restart"))
    assert settings.vllm.urls == ("h:1",) and settings.sglang == SGLangOptions()  # the caller's list copied
    built = build_engine(settings)
    flags = make_engine("vllm", vllm_urls=["h:1"], vllm_sync_weights=True, partial_rollouts="restart",
                        request_timeout_s=5.0)
    assert type(built) is type(flags) is VLLMSyncEngine and built._partial == flags._partial == "restart"
    with pytest.raises(ConfigError, match="--vllm-sync-weights is for --engine vllm --vllm-url URL"):
        build_engine(EngineSettings("sglang", sglang=SGLangOptions(urls=("h:1",)), vllm=VLLMOptions(sync_weights=True)))
    with pytest.raises(ConfigError, match="request_timeout_s=0 must be > 0"):
        HTTPEngineOptions(request_timeout_s=0)
