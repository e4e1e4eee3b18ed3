"""rollstream's thread primitive (`rollstream.infra.threads`), and the lag reader's reads on the caller's thread.

Pinned: a `ThreadPool` runs at most `size` calls at once in daemon threads named after it, so a hung call
holds one slot and the others go on; closing never waits for a hung call and cancels what had not
started; a retired pool runs what was submitted, then its threads end; a `WorkerThread` is a pool of one that
ends with its loop; a bounded call that overruns is left to its thread; `in_thread` runs a one-off call in a
thread of its own. `LagReader` reads committed offsets on the
caller's thread (librdkafka keeps the timeout), never in a thread that could outlive the client it uses.
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import TopicPartition
from rollstream.infra import KafkaConfig, LagReader
from rollstream.infra.threads import BoundedCaller, ThreadPool, WorkerThread, call_within, in_thread
from rollstream.schemas import LifecycleError


def test_a_pool_is_bounded_named_and_a_hung_call_holds_one_slot() -> None:
    pool = ThreadPool("t-pool", 2)
    release = threading.Event()
    names: list[str] = []

    def hang() -> None:
        release.wait()

    def quick(i: int) -> int:
        names.append(threading.current_thread().name)
        return i

    async def scenario() -> list[int]:
        hung = asyncio.ensure_future(pool.run(hang))
        out = [await asyncio.wait_for(pool.run(quick, i), 2.0) for i in range(5)]  # the one free slot
        hung.cancel()
        return out

    try:
        assert asyncio.run(scenario()) == [0, 1, 2, 3, 4]
        assert set(names) <= {"t-pool_0", "t-pool_1"}
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("t-pool_"))
        assert sum(t.name.startswith("t-pool_") for t in threading.enumerate()) == 2
    finally:
        release.set()
        pool.close()


def test_closing_a_pool_never_waits_and_cancels_what_had_not_started() -> None:
    pool = ThreadPool("t-close", 1)
    release = threading.Event()
    running = pool.submit(release.wait)
    waiting = pool.submit(lambda: 1)
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 0.5 and waiting.cancelled() and not running.done()
    with pytest.raises(LifecycleError, match="closed"):
        pool.submit(lambda: 2)
    release.set()
    assert running.result(2.0) is True


def test_a_retired_pool_runs_what_was_submitted_then_its_threads_end() -> None:
    pool, ran = ThreadPool("retired", 2), []
    futures = [pool.submit(ran.append, i) for i in range(5)]
    pool.retire()
    with pytest.raises(LifecycleError):
        pool.submit(ran.append, 99)
    assert pool.join(5.0) and all(f.done() and not f.cancelled() for f in futures) and sorted(ran) == [0, 1, 2, 3, 4]
    assert not any(t.name.startswith("retired_") for t in threading.enumerate())


def test_a_worker_thread_is_a_pool_of_one_that_ends_with_its_loop() -> None:
    class Ticker(WorkerThread):
        def __init__(self) -> None:
            super().__init__()
            self.ticks = 0

        def start(self) -> None:
            self._launch(self._run, "ticker")

        def _run(self) -> None:
            while not self._stop.wait(0.01):
                self.ticks += 1

    ticker = Ticker()
    assert not ticker.started and ticker.join(0)
    ticker.start()
    assert ticker.running and not ticker.join(0.05)
    ticker.stop()
    assert ticker.join(5.0) and not ticker.running and ticker.started and ticker.ticks > 0
    time.sleep(0.05)  # the pool's thread takes the retire marker after the loop
    assert not any(t.name.startswith("ticker_") for t in threading.enumerate())


def test_a_bounded_call_that_overruns_is_left_to_its_thread_and_the_next_gets_a_fresh_one() -> None:
    release, caller = threading.Event(), BoundedCaller("bounded")
    assert caller.call(lambda: 1, 1.0) == (True, 1)
    began = time.monotonic()
    assert caller.call(release.wait, 0.1) == (False, None) and time.monotonic() - began < 1.0
    assert caller.call(lambda: 2, 1.0) == (True, 2)  # not queued behind the overrunning call
    release.set()
    caller.close()
    assert call_within(lambda: 3, 1.0, "once") == (True, 3)


def test_in_thread_runs_in_a_thread_of_its_own() -> None:
    async def scenario() -> str:
        return await in_thread(lambda: threading.current_thread().name, name="t-once")

    assert asyncio.run(scenario()) == "t-once_0"


class _Consumer:
    """What `LagReader` asks of a consumer; records the thread each committed-offsets lookup ran in."""

    def __init__(self, threads: list[int]) -> None:
        self.threads = threads

    def list_topics(self, topic: str, timeout: float) -> Any:
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: None, 1: None})})

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.threads.append(threading.get_ident())
        return [TopicPartition(tp.topic, tp.partition, 3) for tp in partitions]

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool, timeout: float) -> tuple[int, int]:
        return 0, 10

    def close(self) -> None:
        return None


def test_the_lag_reader_reads_committed_offsets_on_the_callers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    monkeypatch.setattr("rollstream.infra.lag.open_consumer", lambda config: _Consumer(threads))
    with LagReader(KafkaConfig()) as reader:
        lags = [reader.group_lag("g", "t", timeout=2.0).total for _ in range(3)]
    assert lags == [14, 14, 14] and threads == [threading.get_ident()] * 3
