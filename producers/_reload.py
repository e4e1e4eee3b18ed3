"""Follow announced policy versions with an engine that loads its own weights (`ReloadableEngine`).

The control watcher calls `WeightFollower.on_version` from its thread; the follower hands the version
to the loop and loads, one at a time, only the newest version announced while a load was running
(versions in between are skipped: nobody wants to generate with them any more). A failed load is
logged and the engine keeps serving its current weights; the next announcement tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from producers.engines.base import EngineError, ReloadableEngine
from producers.metrics import ProducerMetrics
from schemas import PolicyVersion

log = logging.getLogger(__name__)


class WeightFollower:
    """Loads announced weights into `engine`. `on_version` is thread-safe; the rest belongs to `loop`."""

    def __init__(self, engine: ReloadableEngine, loop: asyncio.AbstractEventLoop,
                 metrics: ProducerMetrics | None = None) -> None:
        self._engine = engine
        self._loop = loop
        self._metrics = metrics
        self._wanted: PolicyVersion | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def on_version(self, version: PolicyVersion) -> None:
        """Schedule loading `version` if it names weights. Thread-safe; returns at once."""
        if not version.weights_path:
            return
        try:
            self._loop.call_soon_threadsafe(self._want, version)
        except RuntimeError:
            pass  # the loop is closed: the producer is gone

    def _want(self, version: PolicyVersion) -> None:
        if self._closed:
            return
        if self._wanted is None or version.version > self._wanted.version:
            self._wanted = version
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._load_newest(), name="rollstream-weights")

    async def _load_newest(self) -> None:
        while self._wanted is not None:
            version, self._wanted = self._wanted, None
            try:
                loaded = await self._engine.reload(str(version.weights_path), version.version)
            except EngineError as exc:
                log.error("could not load policy version %d from %s; still serving version %s: %s",
                          version.version, version.weights_path, self._engine.weight_version, exc)
                self._count("failed")
                continue
            if loaded:
                self._count("loaded")

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.weight_reloads.labels(result=result).inc()
            serving = self._engine.weight_version
            self._metrics.weight_version.set(-1 if serving is None else serving)

    async def close(self) -> None:
        """Stop loading (a load in progress is cancelled; the engine keeps what it serves). Idempotent."""
        self._closed = True
        self._wanted = None
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
