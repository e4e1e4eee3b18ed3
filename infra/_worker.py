"""A named daemon thread that runs until asked to stop: the shared lifecycle of rollstream's background readers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class WorkerThread:
    """Owns one background thread and the Event that asks it to stop.

    Subclasses call `_launch` once and poll `self._stop` in their loop. `stop` never blocks; `join`
    waits a bounded time. Thread-safe.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _launch(self, target: Callable[..., None], name: str, *args: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=target, args=args, name=name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end (within one poll interval). Idempotent; never blocks."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Block up to `timeout` s for the thread to end (after `stop`); True when it has (or never ran)."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()
