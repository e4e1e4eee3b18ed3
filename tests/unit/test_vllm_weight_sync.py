"""vLLM servers whose weights the producer updates (`VLLMSyncEngine`, ``--vllm-sync-weights``) and samples
that a weight update aborts, without a broker, against the vLLM stand-in (tests/standins/vllm_server.py: 0.33
by default, ``version="0.32"`` as a real vLLM 0.32.0 answered; ``/collective_rpc`` ``reload_weights`` as
vllm/entrypoints/serve/dev/rpc/api_router.py and vllm/v1/worker/gpu_model_runner.py have it).

Pinned: `VLLMSyncEngine.reload` sends each server ``/pause?mode=abort``, ``/collective_rpc``
``reload_weights(weights_path)``, ``/update_weight_version``, ``/resume``, and a sample in flight is
continued on the new weights: its tokens and logprobs exactly the old weights' then the new weights', the
continuation's ``max_tokens`` reduced, a version span per segment, on 0.33 (spans the server reports) and
0.32 (spans the engine stamps); the version each server serves is read from ``/weight_info`` at start
(``"default"``: unknown); a failed reload is raised naming the server and vLLM's message, the server keeps
its version and is resumed, and the next reload updates only what is stale; a server without
``VLLM_SERVER_DEV_MODE=1`` is refused at start and at reload, naming the fix; `ServerFleet.ticket` stamps a
version only when the request's era is certain; the flags choose the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rollstream.producers import make_engine
from rollstream.producers.engines import EngineError, RetryPolicy, SamplingParams, VLLMHTTPEngine, VLLMSyncEngine
from rollstream.producers.engines._weight_sync import ServerFleet
from rollstream.producers.engines.base import Completion, ReloadableEngine
from rollstream.schemas import ConfigError, VersionSpan

from tests.standins.sglang_server import CharTokenizer
from tests.standins.vllm_server import VLLMStandIn, logprob_at, token_at
from tests.unit._produce_cli import produce_builds

PROMPT = {"id": "p1", "prompt": "2+2?", "label": "4", "metadata": {}, "epoch": 0}
IDS = [ord(ch) for ch in "2+2?"]
FAST = RetryPolicy(attempts=3, abort_attempts=2, backoff_s=0.01, max_backoff_s=0.02)
SYNC_PATHS = ("/pause", "/collective_rpc", "/update_weight_version", "/resume")
MAX_NEW = 40


@pytest.fixture(params=["0.33", "0.32"])
def servers(request: pytest.FixtureRequest) -> Iterator[tuple[VLLMStandIn, VLLMStandIn]]:
    with VLLMStandIn(version=request.param, token_delay_s=0.01) as a, \
            VLLMStandIn(version=request.param, token_delay_s=0.01) as b:
        for server in (a, b):
            server.weight_version = "0"  # the trainer's first weights, labelled
        yield a, b


def sync_engine(*servers: VLLMStandIn, **kwargs: Any) -> VLLMSyncEngine:
    return VLLMSyncEngine([s.url for s in servers], tokenizer=CharTokenizer(), retry=FAST, **kwargs)


def sync_requests(server: VLLMStandIn) -> list[tuple[str, dict[str, Any]]]:
    return [(path, body) for path, body in list(server.requests) if path in SYNC_PATHS]


def expected(split: int) -> tuple[list[int], list[float]]:
    """A sample of PROMPT made by the first weights up to `split`, by the reloaded ones from there."""
    weights = [0 if i < split else 1 for i in range(MAX_NEW)]
    return ([token_at(len(IDS) + i, w) for i, w in enumerate(weights)],
            [logprob_at(len(IDS) + i, w) for i, w in enumerate(weights)])


def test_reload_mid_generation_continues_on_the_new_weights(servers: tuple[VLLMStandIn, VLLMStandIn],
                                                            tmp_path: Path) -> None:
    a, b = servers
    engine = sync_engine(a, b)

    async def go() -> list[Completion]:
        await engine.start()
        try:
            assert isinstance(engine, ReloadableEngine) and engine.serving() == {a.url: 0, b.url: 0}
            task = asyncio.create_task(engine.generate(PROMPT, 2, SamplingParams(max_new_tokens=MAX_NEW,
                                                                                 temperature=0.0)))
            while a.tokens_generated < 4 or b.tokens_generated < 4:
                await asyncio.sleep(0.005)
            assert await engine.reload(str(tmp_path), 1) is True
            return list((await task).completions)
        finally:
            await engine.close()

    completions = asyncio.run(go())
    assert engine.policy_version == 1
    for server in (a, b):
        assert sync_requests(server) == [
            ("/pause", {"mode": "abort"}),
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}),
            ("/update_weight_version", {"new_version": "1"}), ("/resume", {})]
        assert server.weights_paths[server.weights] == str(tmp_path)
        assert httpx.get(server.url + "/weight_info").json() == {"weight_version": "1"}
    bodies = a.completions() + b.completions()
    for c in completions:
        first, second = c.version_spans
        split = first.end
        assert 0 < split < MAX_NEW and first == VersionSpan(0, 0, split) and second == VersionSpan(1, split, MAX_NEW)
        tokens, logprobs = expected(split)
        assert list(c.tokens) == tokens and list(c.logprobs or []) == pytest.approx(logprobs)
        assert c.finish_reason == "length"
        continuation = next(body for body in bodies if body["prompt"] == IDS + tokens[:split])
        assert continuation["max_tokens"] == MAX_NEW - split


def test_failed_reload_keeps_the_old_version_and_resumes(tmp_path: Path) -> None:
    with VLLMStandIn(version="0.32") as a, VLLMStandIn(version="0.32") as b:
        a.weight_version = b.weight_version = "0"
        b.fail_reloads = True
        engine = sync_engine(a, b)

        async def go() -> tuple[str, list[Completion]]:
            await engine.start()
            try:
                with pytest.raises(EngineError) as err:
                    await engine.reload(str(tmp_path), 1)
                assert engine.serving() == {a.url: 1, b.url: 0} and engine.policy_version == 0
                after = await engine.generate(PROMPT, 2, SamplingParams(max_new_tokens=3))  # b was resumed
                b.fail_reloads = False
                assert await engine.reload(str(tmp_path), 1) is True
                return str(err.value), list(after.completions)
            finally:
                await engine.close()

        message, after = asyncio.run(go())
        assert b.url in message and "Cannot find any model weights" in message and a.url not in message
        assert [p for p, _ in sync_requests(b)] == ["/pause", "/collective_rpc", "/resume", *SYNC_PATHS]
        assert [p for p, _ in sync_requests(a)] == list(SYNC_PATHS)  # loaded already: not again
        assert a.weight_version == b.weight_version == "1" and engine.serving() == {a.url: 1, b.url: 1}
    assert sorted((span.version, span.start, span.end) for c in after for span in c.version_spans) == [
        (0, 0, 3), (1, 0, 3)]  # one sample on each server


def test_versions_at_start_and_a_server_without_dev_mode(tmp_path: Path) -> None:
    with VLLMStandIn(version="0.32") as fresh, VLLMStandIn(dev_mode=False) as plain:
        engine = sync_engine(fresh)

        async def go() -> None:
            await engine.start()
            try:
                assert engine.serving() == {fresh.url: None} and engine.policy_version is None  # "default"
                fresh.dev_mode = False  # restarted without VLLM_SERVER_DEV_MODE=1
                with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1") as err:
                    await engine.reload(str(tmp_path), 1)
                assert not err.value.retriable and engine.policy_version is None
            finally:
                await engine.close()
        asyncio.run(go())
        refused = sync_engine(plain)

        async def start() -> None:
            try:
                await refused.start()
            finally:
                await refused.close()
        with pytest.raises(ConfigError, match=r"/weight_info: HTTP 404: start vLLM with VLLM_SERVER_DEV_MODE=1"):
            asyncio.run(start())


def test_a_version_is_stamped_only_when_the_requests_era_is_certain() -> None:
    fleet = ServerFleet(["u"])
    steps = _GatedSteps()

    def answer(ticket: Any, finish: str = "length", n: int = 3) -> tuple[VersionSpan, ...]:
        return tuple(ticket(Completion(text="", tokens=[7] * n, finish_reason=finish)).version_spans)

    async def go() -> None:
        await fleet.start(_version_zero)
        in_flight, late = await fleet.ticket("u"), await fleet.ticket("u")  # sent while version 0 served
        update = asyncio.create_task(fleet.reload("/w1", 1, steps))
        await steps.pausing.wait()  # /pause sent, not answered: a request now could run before it or after
        racing = asyncio.create_task(fleet.ticket("u"))
        await asyncio.sleep(0.01)
        assert not racing.done()  # held back until the pause answered
        assert answer(in_flight, "abort") == (VersionSpan(0, 0, 3),)  # aborted by the pause: it ran on 0
        steps.paused.set()
        await steps.loading.wait()
        queued = await fleet.ticket("u")  # sent while paused: it runs once resumed
        steps.loaded.set()
        await update
        assert answer(await racing, n=2) == (VersionSpan(1, 0, 2),) and answer(queued) == (VersionSpan(1, 0, 3),)
        assert answer(late) == ()  # finished on 0 before the pause, or queued and run on 1: not stamped
        assert answer(await fleet.ticket("u")) == (VersionSpan(1, 0, 3),)
        assert answer(await fleet.ticket("u"), "abort", 0) == ()  # no tokens: nothing to stamp
    asyncio.run(go())


async def _version_zero(url: str) -> int:
    return 0


class _GatedSteps:
    label = "test"

    def __init__(self) -> None:
        self.pausing, self.paused = asyncio.Event(), asyncio.Event()
        self.loading, self.loaded = asyncio.Event(), asyncio.Event()

    async def pause(self, url: str) -> None:
        self.pausing.set()
        await self.paused.wait()

    async def load(self, url: str, weights_path: str, version: int) -> None:
        self.loading.set()
        await self.loaded.wait()

    async def label_version(self, url: str, version: int) -> None:
        pass

    async def resume(self, url: str) -> None:
        pass


def test_flags_choose_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    synced = make_engine("vllm", vllm_urls=["h:1,h:2"], vllm_sync_weights=True, partial_rollouts="restart")
    plain = make_engine("vllm", vllm_urls=["h:1"])
    assert isinstance(synced, VLLMSyncEngine) and isinstance(synced, ReloadableEngine)
    assert synced.urls == ["http://h:1", "http://h:2"] and synced._partial == "restart"
    assert type(plain) is VLLMHTTPEngine and not isinstance(plain, ReloadableEngine) and plain._partial == "continue"
    with pytest.raises(ConfigError, match="--vllm-sync-weights is for --engine vllm --vllm-url"):
        make_engine("sglang", sglang_urls=["h:1"], vllm_sync_weights=True)
    engine, settings = produce_builds(monkeypatch, "--engine", "vllm", "--vllm-url", "h:1", "--vllm-sync-weights",
                                      "--partial-rollouts", "restart")
    assert isinstance(engine, VLLMSyncEngine) and engine._partial == "restart"
    assert not hasattr(settings, "partial_rollouts")  # engine options are the engine's (EngineSettings)
