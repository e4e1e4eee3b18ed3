"""Bounding a blocking librdkafka call that has no timeout of its own (a synchronous offset commit).

librdkafka's synchronous commit waits for the group coordinator's answer with no deadline; a client
whose coordinator is gone for good (confluentinc/librdkafka#5511) would hold its caller forever. The
call runs in a daemon thread instead, and the caller waits at most `timeout`: on a timeout the call
may still finish (and its commit land) later, which callers must allow for.

`call_within` starts a thread per call (for calls made once, such as closing a client), unless given a
`BoundedCaller`, which keeps its thread between calls (for a client that commits every step: no thread
started and joined per commit). A call that overruns keeps that thread, and the next call gets a fresh one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def call_within(fn: Callable[[], _T], timeout: float, name: str, *,
                caller: BoundedCaller | None = None) -> tuple[bool, _T | None]:
    """Run `fn` in `caller`'s kept thread, or in a daemon thread `name` of its own; wait up to `timeout` s.
    Returns (finished, result); re-raises what `fn` raised when it finished by raising."""
    if caller is not None:
        return caller.call(fn, timeout)
    once = BoundedCaller(name)
    try:
        return once.call(fn, timeout)
    finally:
        once.close()


_Job = tuple[Callable[[], Any], dict[str, Any], threading.Event]


class BoundedCaller:
    """Runs blocking calls, one at a time, in a daemon thread kept between calls, waiting at most a
    timeout for each. Thread-safe (calls are serialized). `close` lets the thread end."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] | None = None

    def call(self, fn: Callable[[], _T], timeout: float) -> tuple[bool, _T | None]:
        """Run `fn` in the kept thread; wait up to `timeout` s. Returns (finished, result); re-raises what
        `fn` raised when it finished by raising. Not finished: `fn` goes on in its thread (which then
        ends when `fn` returns) and the next call gets a fresh thread."""
        outcome: dict[str, Any] = {}
        done = threading.Event()
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self._jobs,), name=self._name, daemon=True).start()
            self._jobs.put((fn, outcome, done))
            if not done.wait(timeout):
                self._jobs.put(None)  # the overrunning thread ends once `fn` returns, if it ever does
                self._jobs = None
                return False, None
        if "error" in outcome:
            raise outcome["error"]
        return True, outcome.get("result")

    def close(self) -> None:
        """Let the kept thread end (after a call still running in it). Idempotent; a later call starts a new one."""
        with self._lock:
            if self._jobs is not None:
                self._jobs.put(None)
                self._jobs = None


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    while (job := jobs.get()) is not None:
        fn, outcome, done = job
        try:
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            outcome["error"] = exc
        done.set()
