"""Plug-in code never runs on the producer's event loop (issue 36, item 3; STYLE.md 16).

Pinned here, each by a heartbeat on the loop that ticks every 50 ms and must never come more than 0.5 s
late while a plug-in sleeps 1 s (``time.sleep``: a tool, a code runner, a model load):

1. an environment's sync ``reply`` (``--environment MODULE:CLASS``) runs in the user threads: the loop keeps
   ticking and another group's episodes finish while it sleeps;
2. a custom generate object's sync ``start()``, ``close()`` and ``reload()`` run off the loop (start and close
   in a thread of their own, so they never queue behind generate calls hung in the user threads);
3. a sync reward function runs in the user threads.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from rollstream.infra.threads import ThreadPool
from rollstream.producers import Completion, CustomEngine, EnvironmentEngine, SamplingParams
from rollstream.producers.engines.base import EngineCapabilities
from rollstream.producers.multiturn import Episode
from rollstream.producers.rewards import Reward

TICK_S = 0.05
MAX_LATE_S = 0.5
SLEEP_S = 1.0
PROMPT = {"id": "p0", "prompt": "2+3", "label": "5", "metadata": {}, "epoch": 0, "attempt": 0}
_T = TypeVar("_T")


async def _late_while(work: Awaitable[_T]) -> tuple[_T, float]:
    """`work`'s result, and the most a 50 ms heartbeat on the loop came late while it ran."""
    late = 0.0

    async def heartbeat() -> None:
        nonlocal late
        while True:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            late = max(late, time.perf_counter() - before - TICK_S)

    ticking = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)  # the heartbeat's first tick is armed before the work starts
    try:
        return await work, late
    finally:
        ticking.cancel()


class _Tokenizer:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


class _Policy:
    """A token engine that answers every turn at once with two tokens."""

    name = "fake"
    capabilities = EngineCapabilities()

    def __init__(self) -> None:
        self.tokenizer = _Tokenizer()

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def generate(self, prompt: Any, n: int, sampling: SamplingParams) -> Any:
        raise AssertionError("an episode's turns go through generate_tokens")

    async def prompt_ids(self, prompt: Any) -> tuple[str, list[int]]:
        return str(prompt["prompt"]), [1, 2, 3]

    async def generate_tokens(self, input_ids: Sequence[int], n: int, sampling: SamplingParams) -> list[Completion]:
        return [Completion(text="", tokens=[4, 5], logprobs=[-0.1, -0.2], finish_reason="length")
                for _ in range(n)]


class _SlowTool:
    """A code runner: its reply blocks for `SLEEP_S` (time.sleep), then ends the episode."""

    threads: list[str] = []

    def __init__(self, tokenizer: Any) -> None: ...

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        _SlowTool.threads.append(threading.current_thread().name)
        time.sleep(SLEEP_S)
        return None


class _FastTool:
    def __init__(self, tokenizer: Any) -> None: ...

    def reply(self, turn: Completion, episode: Episode) -> list[int] | None:
        return [7] if episode.policy_turns < 2 else None


def test_a_sleeping_environment_reply_neither_stalls_the_loop_nor_another_group() -> None:
    threads = ThreadPool("rollstream-user", 4)
    slow, fast = EnvironmentEngine(_Policy(), _SlowTool), EnvironmentEngine(_Policy(), _FastTool)
    sampling = SamplingParams(max_new_tokens=2)
    _SlowTool.threads = []

    async def timed(engine: EnvironmentEngine) -> float:
        started = time.perf_counter()
        await engine.generate(PROMPT, 2, sampling)
        return time.perf_counter() - started

    async def both() -> list[float]:
        for engine in (slow, fast):
            engine.use_threads(threads)
        return list(await asyncio.gather(timed(slow), timed(fast)))

    try:
        (slow_s, fast_s), late_s = asyncio.run(_late_while(both()))
    finally:
        threads.close()
    assert late_s < MAX_LATE_S, f"the loop's heartbeat came {late_s:.2f} s late while a reply slept"
    assert slow_s >= SLEEP_S and fast_s < MAX_LATE_S  # the other group went on while the reply slept
    assert _SlowTool.threads and all(name.startswith("rollstream-user_") for name in _SlowTool.threads)


class _Agent:
    """A generate object whose sync hooks block (a model that loads, a client that drains)."""

    def __init__(self) -> None:
        self.ran: dict[str, str] = {}
        self.policy_version = 0

    def _block(self, hook: str) -> None:
        self.ran[hook] = threading.current_thread().name
        time.sleep(SLEEP_S)

    def start(self) -> None:
        self._block("start")

    def close(self) -> None:
        self._block("close")

    def reload(self, weights_path: str, version: int) -> bool:
        self._block("reload")
        self.policy_version = version
        return True

    async def __call__(self, prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"text": "a", "tokens": [1]} for _ in range(n)]


def test_a_custom_engines_sync_hooks_run_off_the_loop() -> None:
    agent = _Agent()
    engine = CustomEngine(agent)
    assert engine.capabilities.reloads_weights

    async def lifecycle() -> None:
        await engine.start()
        assert await engine.reload("/ckpt/v1", 1)  # type: ignore[attr-defined]
        await engine.close()

    _, late_s = asyncio.run(_late_while(lifecycle()))
    assert late_s < MAX_LATE_S, f"the loop's heartbeat came {late_s:.2f} s late while a hook slept"
    assert agent.ran["start"].startswith("rollstream-user-start") and agent.ran["close"].startswith(
        "rollstream-user-close") and agent.ran["reload"].startswith("rollstream-user")
    assert agent.policy_version == 1


def test_a_sleeping_sync_reward_does_not_stall_the_loop() -> None:
    def reward(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
        time.sleep(SLEEP_S)
        return 1.0

    score = Reward(reward, name="tests:sleepy")
    value, late_s = asyncio.run(_late_while(score(PROMPT, {"text": "5"})))
    assert value == 1.0 and late_s < MAX_LATE_S
