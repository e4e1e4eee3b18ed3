"""SGLang weight sync owned by the producer, without a broker.

Pinned: `SGLangSyncEngine.reload` pauses, updates (``model_path``, ``weight_version``) and continues every
server not yet at the version, and a sample in flight is continued on the new weights; a failed update
leaves that server on its old weights and version, still continued (never left paused), is raised naming
the server and counted by the policy follower, and the next reload updates only what is stale; the
in-process `SGLangEngine` reloads through the tokenizer manager coroutines that ``sglang.Engine`` wraps
(fake objects with upstream's signatures); the flags choose the engine and are validated.
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import make_engine
from rollstream.producers.engines import EngineError, RetryPolicy, SamplingParams, SGLangEngine, SGLangHTTPEngine
from rollstream.producers.engines.base import ReloadableEngine
from rollstream.producers.engines.options import HTTPEngineOptions
from rollstream.producers.engines.sglang_http import SGLangSyncEngine
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.policy import PolicyFollower
from rollstream.schemas import ConfigError, PolicyVersion, VersionSpan, write_policy_version

from tests.standins.sglang_server import CharTokenizer, SGLangStandIn
from tests.unit._produce_cli import produce_builds

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}

FAST = RetryPolicy(attempts=3, backoff_s=0.01, max_backoff_s=0.02)
SYNC_PATHS = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


@pytest.fixture
def servers() -> Iterator[tuple[SGLangStandIn, SGLangStandIn]]:
    with SGLangStandIn(weight_version="1", token_delay_s=0.01) as a, \
            SGLangStandIn(weight_version="1", token_delay_s=0.01) as b:
        yield a, b


def sync_engine(*servers: SGLangStandIn) -> SGLangSyncEngine:
    return SGLangSyncEngine([s.url for s in servers], tokenizer=CharTokenizer(), retry=FAST)


def after_start(server: SGLangStandIn) -> list[tuple[str, dict[str, Any]]]:
    return [(path, body) for path, body in list(server.requests) if path not in ("/model_info", "/get_weight_version")]


def test_reload_updates_every_server_and_in_flight_samples_continue(servers: tuple[SGLangStandIn, SGLangStandIn],
                                                                      tmp_path: Path) -> None:
    a, b = servers
    engine = sync_engine(a, b)

    async def go() -> tuple[Any, bool, bool]:
        await engine.start()
        try:
            assert isinstance(engine, ReloadableEngine) and engine.policy_version == 1
            task = asyncio.create_task(engine.generate(PROMPT, 2, SamplingParams(max_new_tokens=24)))
            while a.tokens_generated < 4 or b.tokens_generated < 4:
                await asyncio.sleep(0.005)
            loaded = await engine.reload(str(tmp_path), 3)
            generation = await task
            (tmp_path / "v2").mkdir()
            lower = await engine.reload(str(tmp_path / "v2"), 2)  # a resumed trainer run's lower version
            return generation, loaded, lower
        finally:
            await engine.close()

    generation, loaded, lower = asyncio.run(go())
    assert loaded is True and lower is True and engine.policy_version == 2
    for server in (a, b):
        sync = [(p, body) for p, body in after_start(server) if p != "/generate"]
        assert sync == [("/pause_generation", {"mode": "abort"}),
                        ("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "3"}),
                        ("/continue_generation", {}),
                        ("/pause_generation", {"mode": "abort"}),
                        ("/update_weights_from_disk", {"model_path": str(tmp_path / "v2"), "weight_version": "2"}),
                        ("/continue_generation", {})]  # the lower one too: the caller decides what to load
        assert server.weight_version == "2" and server.model_path == str(tmp_path / "v2")
    for c in generation.completions:
        assert [s.version for s in c.version_spans] == [1, 3] and len(c.tokens) == 24


def test_failed_update_keeps_the_old_weights_and_is_reported(servers: tuple[SGLangStandIn, SGLangStandIn],
                                                             tmp_path: Path) -> None:
    a, b = servers
    b.fail_updates = True
    engine = sync_engine(a, b)
    metrics = ProducerMetrics()
    count = metrics.registry.get_sample_value

    async def go() -> tuple[str, Any]:
        await engine.start()
        follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False)
        await follower.start(catch_up_timeout=0)
        try:
            with pytest.raises(EngineError) as err:
                await engine.reload(str(tmp_path), 2)
            follower.on_announced(PolicyVersion(3, weights_path=str(tmp_path)))
            while count("rollstream_producer_weight_reloads_total", {"result": "failed"}) != 1:
                await asyncio.sleep(0.005)
            on_b = await engine.generate(PROMPT, 2, SamplingParams(max_new_tokens=4))  # b is not left paused
            b.fail_updates = False
            assert await engine.reload(str(tmp_path), 3) is True
            return str(err.value), on_b
        finally:
            await follower.close()
            await engine.close()

    message, on_b = asyncio.run(go())
    assert b.url in message and "Failed to get weights iterator" in message and a.url not in message
    assert [p for p, _ in after_start(b) if p != "/generate"] == SYNC_PATHS * 3  # continued after each failure
    assert [p for p, _ in after_start(a) if p != "/generate"] == SYNC_PATHS * 2  # not again for version 3
    assert {tuple(s.version for s in c.version_spans) for c in on_b.completions} == {(3,), (1,)}
    assert a.weight_version == b.weight_version == "3" and engine.serving() == {a.url: 3, b.url: 3}
    assert count("rollstream_producer_weight_reloads_total", {"result": "loaded"}) is None


def test_unknown_versions_until_loaded(tmp_path: Path) -> None:
    with SGLangStandIn() as fresh:  # "default": nothing loaded with a version
        engine = sync_engine(fresh)

        async def go() -> int | None:
            await engine.start()
            try:
                assert engine.policy_version is None
                with pytest.raises(EngineError, match="cannot be loaded"):
                    await engine.reload(str(tmp_path / "missing"), 1)
                assert engine.policy_version is None
                await engine.reload(str(tmp_path), 1)
                return engine.policy_version
            finally:
                await engine.close()
        assert asyncio.run(go()) == 1


# -- the in-process engine, with fakes following upstream's signatures ---------------------------------------
# python/sglang/srt/managers/io_struct.py (001067ff): PauseGenerationReqInput(mode), ContinueGenerationReqInput,
# UpdateWeightFromDiskReqInput(model_path, load_format=None, abort_all_requests=False, weight_version=None, ...);
# tokenizer_manager.py: async pause_generation(obj), continue_generation(obj), update_weights_from_disk(obj,
# request) -> (success, message, num_paused_requests); engine.py: Engine(**server_args), .tokenizer_manager.

@dataclass
class PauseGenerationReqInput:
    mode: str = "abort"


@dataclass
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class FakeTokenizerManager:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.weight_version = "default"
        self.fail = False

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.calls.append(("pause", obj))

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.calls.append(("continue", obj))

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput, request: Any) -> tuple[bool, str, int]:
        self.calls.append(("update", obj))
        if self.fail:
            return False, "Failed to get weights iterator: no such file.", 0
        self.weight_version = obj.weight_version or self.weight_version
        return True, "Succeeded to update model weights.", 0


class FakeEngine:
    def __init__(self, **server_args: Any) -> None:
        self.server_args = server_args
        self.tokenizer_manager = FakeTokenizerManager()

    async def async_generate(self, **kwargs: Any) -> dict[str, Any]:
        version = self.tokenizer_manager.weight_version
        return {"text": "ab", "output_ids": [7, 8], "meta_info": {
            "finish_reason": {"type": "length", "length": 2}, "weight_version": version,
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]]}}

    def shutdown(self) -> None:
        pass


def test_in_process_engine_reloads_through_the_tokenizer_manager(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    io_struct = types.SimpleNamespace(PauseGenerationReqInput=PauseGenerationReqInput,
                                      ContinueGenerationReqInput=ContinueGenerationReqInput,
                                      UpdateWeightFromDiskReqInput=UpdateWeightFromDiskReqInput)
    made: list[FakeEngine] = []

    def launch(**server_args: Any) -> FakeEngine:  # sglang.Engine(**server_args)
        made.append(FakeEngine(**server_args))
        return made[-1]

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=launch))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    monkeypatch.setattr("rollstream.producers.engines.sglang_engine.load_tokenizer", lambda path: CharTokenizer())
    write_policy_version(tmp_path, 4)
    engine = SGLangEngine(tmp_path)

    async def go() -> tuple[Any, Any]:
        await engine.start()
        try:
            manager = made[-1].tokenizer_manager
            manager.weight_version = made[-1].server_args["weight_version"]
            before = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=2))
            assert await engine.reload(str(tmp_path / "v5"), 5) is True
            manager.fail = True
            with pytest.raises(EngineError, match="could not load .* as version 6: Failed to get weights"):
                await engine.reload(str(tmp_path / "v6"), 6)
            after = await engine.generate(PROMPT, 1, SamplingParams(max_new_tokens=2))
            return before, after
        finally:
            await engine.close()

    before, after = asyncio.run(go())
    fake = made[-1]
    assert fake.server_args["weight_version"] == "4" and isinstance(engine, ReloadableEngine)
    assert [name for name, _ in fake.tokenizer_manager.calls] == ["pause", "update", "continue"] * 2
    _, update = fake.tokenizer_manager.calls[1]
    assert update == UpdateWeightFromDiskReqInput(model_path=str(tmp_path / "v5"), weight_version="5")
    assert fake.tokenizer_manager.calls[0][1] == PauseGenerationReqInput(mode="abort")
    assert engine.policy_version == 5  # the failed version 6 did not replace it
    assert before.completions[0].version_spans == (VersionSpan(4, 0, 2),)
    assert after.completions[0].version_spans == (VersionSpan(5, 0, 2),)


def test_flags_choose_the_engine() -> None:
    synced = make_engine("sglang", sglang_urls=["h:1,h:2"], sglang_sync_weights=True, partial_rollouts="restart")
    plain = make_engine("sglang", sglang_urls=["h:1"])
    assert isinstance(synced, SGLangSyncEngine) and isinstance(synced, ReloadableEngine)
    assert isinstance(plain, SGLangHTTPEngine) and not isinstance(plain, ReloadableEngine)
    assert synced.urls == ["http://h:1", "http://h:2"] and synced._partial == "restart"
    with pytest.raises(ConfigError, match="--sglang-sync-weights is for --engine sglang --sglang-url"):
        make_engine("hf", model="/m", sglang_sync_weights=True)
    with pytest.raises(ConfigError, match="partial_rollouts='sometimes'"):
        HTTPEngineOptions(partial_rollouts="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="continue or restart"):
        SGLangHTTPEngine(["h:1"], partial_rollouts="later")  # type: ignore[arg-type]


def test_produce_cli_passes_the_engine_flags_to_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--engine", "sglang", "--sglang-url", "h:1"]
    engine, settings = produce_builds(monkeypatch, *args, "--sglang-sync-weights", "--partial-rollouts", "restart")
    assert isinstance(engine, SGLangSyncEngine) and engine._partial == "restart"
    assert not hasattr(settings, "partial_rollouts")  # engine options are the engine's (EngineSettings)
    engine, settings = produce_builds(monkeypatch, *args)
    assert type(engine) is SGLangHTTPEngine and engine._partial == "continue"
