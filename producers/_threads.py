"""Named, bounded thread pools, so user code and infrastructure never wait on each other's threads.

asyncio's default executor is one pool for everything: once enough sync generate or reward functions
hang in it, tokenization, encoding, flushes and joins queue behind them, and `asyncio.run` waits for its
threads at exit. So the producer runs sync user code in a `ThreadPool` of its own (``rollstream-user``,
sized by ``ProducerSettings.user_threads``) and its own blocking work in others (``rollstream-infra``,
an HTTP engine's ``rollstream-tokenize``); one-off calls at start and close get a thread each
(`in_thread`). A hung user function holds its own slot only: its awaiting coroutine is released by the
group's deadline, and the thread is a daemon, so it never holds up the producer's close or the process's
exit.

Unlike `concurrent.futures.ThreadPoolExecutor` (whose threads are joined at interpreter exit), the
threads are daemons, started on demand up to `size`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from rollstream.schemas import ConfigError, LifecycleError

_T = TypeVar("_T")
_Job = tuple[concurrent.futures.Future[Any], Callable[[], Any]]


class ThreadPool:
    """Runs blocking calls in at most `size` daemon threads named ``{name}_{i}``. `run` is loop-safe;
    `submit` and `close` are thread-safe. Closing cancels calls not yet started; running ones finish (or
    hang) in their threads, which end afterwards."""

    def __init__(self, name: str, size: int) -> None:
        if size < 1:
            raise ConfigError(f"thread pool {name}: size {size} must be >= 1")
        self.name, self.size = name, size
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0
        self._closed = False

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in a thread of this pool; cancelling the caller cancels it unless it started.

        Raises:
            LifecycleError: the pool is closed (the producer is closing); else what `fn` raises.
        """
        return await asyncio.wrap_future(self.submit(functools.partial(fn, *args)))

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Queue `fn`; a thread is started when none is idle and fewer than `size` run."""
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise LifecycleError(f"thread pool {self.name} is closed: the producer is closing, nothing more runs")
            self._jobs.put((future, fn))
            if not self._idle.acquire(blocking=False) and self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"{self.name}_{self._threads - 1}", daemon=True).start()
        return future

    def close(self) -> None:
        """Cancel what has not started and let every thread end. Idempotent; never blocks."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            for _ in range(self._threads):
                self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                    future.set_exception(exc)
            del job, future, fn  # drop references before idling
            self._idle.release()


async def in_thread(fn: Callable[..., _T], *args: Any, name: str) -> _T:
    """`fn(*args)` in a daemon thread `name` of its own, for a call made once (at start or close), so it
    never queues behind a pool's work. Raises what `fn` raises."""
    pool = ThreadPool(name, 1)
    try:
        return await pool.run(fn, *args)
    finally:
        pool.close()


class ProducerThreads:
    """A producer's pools: `user` (``rollstream-user``, `user_size` threads) for sync generate and reward
    functions, `infra` (``rollstream-infra``) for its own blocking work (encoding a large group, reading the
    prompts' lag). Built first and closed last by `rollstream.producers._parts`. Thread-safe."""

    def __init__(self, user_size: int, infra_size: int = 4) -> None:
        self.user = ThreadPool("rollstream-user", user_size)
        self.infra = ThreadPool("rollstream-infra", infra_size)

    def close(self) -> None:
        """Close both pools (a hung user call keeps only its own daemon thread). Idempotent; never blocks."""
        self.user.close()
        self.infra.close()
