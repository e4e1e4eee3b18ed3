"""rollstream's one thread primitive: named, bounded pools of daemon threads, so user code and infrastructure
never wait on each other's threads, and nothing starts a thread of its own.

asyncio's default executor is one pool for everything: once enough sync generate or reward functions
hang in it, tokenization, encoding, flushes and joins queue behind them, and `asyncio.run` waits for its
threads at exit. So each kind of blocking work gets a `ThreadPool` of its own (a producer's
``rollstream-user`` for sync user code and ``rollstream-infra`` for its own work, an HTTP engine's
``rollstream-tokenize``, a trainer adapter's one thread for its consumer); one-off calls at start and
close get a thread each (`in_thread`); a background loop that runs until asked to stop (a reader, a
poller) is a `WorkerThread`, itself a pool of one; a blocking call that has no timeout of its own (closing a
librdkafka client) is waited for at most a timeout with `call_within` / a `BoundedCaller`, a pool of one
that is given up on, never interrupted, when the call overruns. A hung call holds its own slot only: its awaiting
coroutine is released by its deadline, and the thread is a daemon, so it never holds up a close or the
process's exit.

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

from rollstream.infra.deadline import Deadline
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
        self._threads: list[threading.Thread] = []
        self._closed = False

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in a thread of this pool; cancelling the caller cancels it unless it started.

        Raises:
            LifecycleError: the pool is closed (the producer is closing); else what `fn` raises.
        """
        return await asyncio.wrap_future(self.submit(fn, *args))

    def submit(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> concurrent.futures.Future[_T]:
        """Queue `fn(*args, **kwargs)`; a thread is started when none is idle and fewer than `size` run. Never
        blocks.

        Raises:
            LifecycleError: the pool is closed or retired.
        """
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if args or kwargs:
            fn = functools.partial(fn, *args, **kwargs)
        with self._lock:
            if self._closed:
                raise LifecycleError(f"thread pool {self.name} is closed: the producer is closing, nothing more runs")
            self._jobs.put((future, fn))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self.size:
                thread = threading.Thread(target=self._serve, name=f"{self.name}_{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
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
            for _ in self._threads:
                self._jobs.put(None)

    def retire(self) -> None:
        """Take nothing more, but run what was submitted; every thread ends after it. Idempotent; never blocks."""
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._jobs.put(None)

    def join(self, timeout: float | None) -> bool:
        """Block up to `timeout` s in all (None: until they do) for every thread to end, after `close` or
        `retire`; True when they have."""
        deadline = Deadline.after(timeout) if timeout is None or timeout > 0 else None
        for thread in list(self._threads):
            thread.join(0 if deadline is None else deadline.timeout())
        return not any(thread.is_alive() for thread in self._threads)

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


class WorkerThread:
    """Owns one background loop, run in a `ThreadPool` of one, and the Event that asks it to stop.

    Subclasses call `_launch` once and poll `self._stop` in their loop. `stop` never blocks; `join`
    waits a bounded time. Thread-safe.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._work: concurrent.futures.Future[None] | None = None

    def _launch(self, target: Callable[..., None], name: str, *args: Any) -> None:
        if self._work is None:
            pool = ThreadPool(name, 1)
            self._work = pool.submit(target, *args)
            pool.retire()  # its thread ends with the loop

    def stop(self) -> None:
        """Ask the loop to end (within one poll interval). Idempotent; never blocks."""
        self._stop.set()

    @property
    def started(self) -> bool:
        """`_launch` was called (the loop may have ended since)."""
        return self._work is not None

    @property
    def running(self) -> bool:
        """The loop was launched and has not ended."""
        return self._work is not None and not self._work.done()

    def join(self, timeout: float) -> bool:
        """Block up to `timeout` s for the loop to end (after `stop`); True when it has (or never ran)."""
        if self._work is None:
            return True
        done, _ = concurrent.futures.wait([self._work], timeout)
        return bool(done)


def call_within(fn: Callable[[], _T], timeout: float, name: str, *,
                caller: BoundedCaller | None = None) -> tuple[bool, _T | None]:
    """Run `fn` in `caller`'s kept thread, or in a daemon thread `name` of its own; wait up to `timeout` s.
    Returns (finished, result); re-raises what `fn` raised when it finished by raising. Not finished: `fn`
    goes on in its thread, which ends when `fn` returns; callers must allow for its effect landing later."""
    if caller is not None:
        return caller.call(fn, timeout)
    once = BoundedCaller(name)
    try:
        return once.call(fn, timeout)
    finally:
        once.close()


class BoundedCaller:
    """Runs blocking calls, one at a time, in a pool of one kept between calls, waiting at most a timeout for
    each. Thread-safe (calls are serialized). A call that overruns keeps that thread (which ends when the
    call returns) and the next call gets a fresh pool. `close` lets the thread end."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPool | None = None

    def call(self, fn: Callable[[], _T], timeout: float) -> tuple[bool, _T | None]:
        """Run `fn` in the kept thread; wait up to `timeout` s. Returns (finished, result); re-raises what `fn`
        raised when it finished by raising."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPool(self._name, 1)
            future = self._pool.submit(fn)
            done, _ = concurrent.futures.wait([future], max(0.0, timeout))
            if not done:
                self._pool.retire()  # its thread ends once `fn` returns, if it ever does
                self._pool = None
                return False, None
        return True, future.result()

    def close(self) -> None:
        """Let the kept thread end. Idempotent; a later call starts a new one."""
        with self._lock:
            if self._pool is not None:
                self._pool.retire()
                self._pool = None
