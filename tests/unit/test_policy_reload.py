"""Weight reloads without a broker: `HFEngine.reload` swaps weights between generations and stamps the
loaded version; `WeightFollower` loads only the newest announced version, one load at a time, and
survives a failed load."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import PolicyFollower
from rollstream.producers.engines.base import EngineCapabilities, EngineError, ReloadableEngine, SamplingParams
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import PolicyVersion, read_policy_version, write_policy_version

PROMPT = {"id": "p1", "prompt": "4+5=", "label": "9", "metadata": {}, "epoch": 0}
SAMPLING = SamplingParams(max_new_tokens=2, temperature=1.0)


def test_weights_version_file_round_trip(tmp_path: Path) -> None:
    assert read_policy_version(tmp_path) is None
    write_policy_version(tmp_path, 7)
    assert read_policy_version(tmp_path) == 7
    (tmp_path / "rollstream_version.json").write_text("not json")
    assert read_policy_version(tmp_path) is None


def test_hf_engine_reloads_between_generations_and_stamps_the_loaded_version(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch
    from rollstream.producers.engines import HFEngine

    from rollstream.demo.task import build_demo_model

    v0 = build_demo_model(tmp_path / "v0", seed=0)
    write_policy_version(v0, 0)
    v1 = build_demo_model(tmp_path / "v1", seed=1)

    async def go() -> None:
        engine = HFEngine(v0, torch_threads=1)
        await engine.start()
        try:
            assert isinstance(engine, ReloadableEngine) and engine.policy_version == 0
            before = await engine.generate(PROMPT, 4, SAMPLING)
            assert {c.policy_version for c in before.completions} == {0}
            assert await engine.reload(str(v1), 1) is True
            after = await engine.generate(PROMPT, 4, SAMPLING)
            assert {c.policy_version for c in after.completions} == {1}
            from transformers import AutoModelForCausalLM
            expected = AutoModelForCausalLM.from_pretrained(str(v1)).state_dict()
            for name, tensor in engine._model.state_dict().items():
                assert torch.equal(tensor, expected[name]), name
            # A resumed trainer run announces a lower version: it is loaded all the same.
            assert await engine.reload(str(v0), 0) is True
            lower = AutoModelForCausalLM.from_pretrained(str(v0)).state_dict()
            for name, tensor in engine._model.state_dict().items():
                assert torch.equal(tensor, lower[name]), name
            assert {c.policy_version for c in (await engine.generate(PROMPT, 2, SAMPLING)).completions} == {0}
            with pytest.raises(EngineError, match="cannot read weights"):
                await engine.reload(str(tmp_path / "missing"), 2)
            assert engine.policy_version == 0
        finally:
            await engine.close()

    asyncio.run(go())


class _FakeEngine:
    """Records reloads; a path containing 'bad' fails; the first reload waits for `release`."""

    name = "fake"
    capabilities = EngineCapabilities(reloads_weights=True)

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt: Any, n: int, sampling: SamplingParams) -> Any:
        raise AssertionError("only reloads here")

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self._version: int | None = 0

    @property
    def policy_version(self) -> int | None:
        return self._version

    async def reload(self, weights_path: str, version: int) -> bool:
        self.started.set()
        await self.release.wait()
        if "bad" in weights_path:
            raise EngineError(f"cannot load {weights_path}", retriable=True)
        self.loaded.append(version)
        self._version = version
        return True


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def test_follower_loads_only_the_newest_pending_version_and_survives_failures() -> None:
    async def go() -> tuple[_FakeEngine, ProducerMetrics]:
        engine, metrics = _FakeEngine(), ProducerMetrics()
        follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False)  # type: ignore[arg-type]
        await follower.start(catch_up_timeout=0)
        count = metrics.registry.get_sample_value
        follower.on_announced(PolicyVersion(1, weights_path="/w/1"))
        await asyncio.wait_for(engine.started.wait(), 10)  # version 1 is loading; 2, 3 and 4 arrive meanwhile
        for v in (2, 3, 4):
            follower.on_announced(PolicyVersion(v, weights_path=f"/w/{v}"))
        follower.on_announced(PolicyVersion(5))  # no weights: nothing to load
        await asyncio.sleep(0)  # let the announcements reach the loop (call_soon_threadsafe)
        engine.release.set()
        await _until(lambda: engine.loaded == [1, 4], "versions 1 and 4 to load")
        follower.on_announced(PolicyVersion(6, weights_path="/w/bad"))
        await _until(lambda: count("rollstream_producer_weight_reloads_total", {"result": "failed"}) == 1,
                     "the load of version 6 to fail")
        follower.on_announced(PolicyVersion(7, weights_path="/w/7"))
        await _until(lambda: engine.loaded == [1, 4, 7], "version 7 to load")
        await follower.close()
        return engine, metrics

    engine, metrics = asyncio.run(go())
    assert engine.loaded == [1, 4, 7]
    count = metrics.registry.get_sample_value
    assert count("rollstream_producer_weight_reloads_total", {"result": "loaded"}) == 3
    assert count("rollstream_producer_weight_reloads_total", {"result": "failed"}) == 1
    assert count("rollstream_producer_weight_version") == 7


def test_follower_follows_a_new_run_down_and_loads_a_same_numbered_version_of_another_run() -> None:
    async def go() -> tuple[_FakeEngine, ProducerMetrics]:
        engine, metrics = _FakeEngine(), ProducerMetrics()
        engine.release.set()
        follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=metrics, watch=False)  # type: ignore[arg-type]
        await follower.start(catch_up_timeout=0)
        # At start the engine serves version 0 (its model directory says so): run 1's version 0 is served.
        follower.on_announced(PolicyVersion(0, weights_path="/r1/0", run=1, run_id="a"))
        for v in (5, 6):
            follower.on_announced(PolicyVersion(v, weights_path=f"/r1/{v}", run=1, run_id="a"))
            await _until(lambda v=v: engine.loaded[-1:] == [v], f"run 1's version {v}")
        follower.on_announced(PolicyVersion(6, weights_path="/r1/6", run=1, run_id="a"))  # a repeat: served
        follower.on_announced(PolicyVersion(3, weights_path="/r2/3", run=2, run_id="b"))  # resumed lower
        await _until(lambda: engine.loaded[-1:] == [3], "run 2's version 3")
        follower.on_announced(PolicyVersion(3, weights_path="/r3/3", run=3, run_id="c"))  # same number, new run
        await _until(lambda: len(engine.loaded) == 4, "run 3's version 3")
        await follower.close()
        return engine, metrics

    engine, metrics = asyncio.run(go())
    assert engine.loaded == [5, 6, 3, 3]
    assert metrics.registry.get_sample_value("rollstream_producer_weight_version") == 3
    assert metrics.registry.get_sample_value("rollstream_producer_policy_run") == 3


class _Agent:
    """A custom generate object that owns its weights (``--generate mymodule:_Agent``)."""

    def __init__(self) -> None:
        self.policy_version = 1
        self.loaded: list[tuple[str, int]] = []

    async def __call__(self, prompt: dict, n: int, sampling_params: dict) -> list[dict]:
        return [{"text": "x", "tokens": [1], "weight_version": self.policy_version}] * n

    def reload(self, weights_path: str, version: int) -> None:  # sync: run in the user threads
        self.loaded.append((weights_path, version))
        self.policy_version = version


def test_a_custom_generate_object_with_reload_gets_announced_weights(tmp_path: Path) -> None:
    from rollstream.producers.engines import CustomEngine

    agent = _Agent()
    engine = CustomEngine(agent)  # one class: what it does is declared, not a class swapped in (issue 36)
    assert engine.capabilities.reloads_weights and isinstance(engine, ReloadableEngine)
    assert not CustomEngine(lambda p, n, s: []).capabilities.reloads_weights  # a plain function: stamps only

    async def go() -> None:
        follower = PolicyFollower(engine, KafkaConfig(), "t.control", metrics=ProducerMetrics(), watch=False)
        await follower.start(catch_up_timeout=0)
        try:
            follower.on_announced(PolicyVersion(1, weights_path=str(tmp_path)))  # served already at start
            follower.on_announced(PolicyVersion(3, weights_path=str(tmp_path / "v3")))
            while engine.policy_version != 3:
                await asyncio.sleep(0.005)
            generated = await engine.generate(PROMPT, 2, SAMPLING)
            assert {c.policy_version for c in generated.completions} == {3}
        finally:
            await follower.close()
            await engine.close()
    asyncio.run(go())
    assert agent.loaded == [(str(tmp_path / "v3"), 3)]
