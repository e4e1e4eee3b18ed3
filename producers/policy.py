"""The producer's policy follower: which policy version generated a sample, and loading announced weights.

It follows NS.control (`rollstream.infra.control.ControlWatcher`, its own thread) for the versions the trainer
announces, by the runs' rule (`rollstream.infra.runs`): the newest trainer run's latest announcement, also when its
version is lower than an older run's (a trainer resumed from a checkpoint); a superseded run's
announcements move nothing (counted in ``rollstream_producer_superseded_announcements_total``).
Where the engine owns its weights (it declares ``reloads_weights``, a `ReloadableEngine`: `HFEngine`, the
in-process `SGLangEngine`, `SGLangSyncEngine` and `VLLMSyncEngine`, servers the producer updates with
``--sglang-sync-weights`` or ``--vllm-sync-weights``, and a custom generate object that has ``reload``), it loads each
announcement to follow that names a ``weights_path``: one load at a time, and only the latest announced
while a load ran (the ones in between are skipped: nobody wants to generate with them any more). It
loads unless the engine serves that very announcement already: a new run's version is loaded even when
its number is the one serving (another run's weights may carry it); only at start does a matching
number count as served (the engine was started with those weights).
A failed load is logged, counted (``rollstream_producer_weight_reloads_total{result="failed"}``) and the
engine keeps serving its current weights (a server that failed keeps reporting its old version); the next
announcement tries again.

A sample's policy version, the one its staleness counts from, in order of precedence (`stamp`):
1. the oldest version the engine reports for the completion's tokens: the first of its version spans
   (SGLang's ``meta_info.weight_versions``, a continued partial rollout's segments), else its
   ``policy_version`` (SGLang's ``meta_info.weight_version``, the loaded version of a `ReloadableEngine`,
   a custom generate function's ``weight_version``);
2. else, when the engine knows no version (SGLang's ``"default"``: nothing was loaded with a version),
   the newest version announced on NS.control *when the generation started* (`version_at_start`, read
   before generating): a version announced during the generation may not be serving yet, and the older
   number is the safe one, since staleness is measured from it;
3. else 0 (nothing announced yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import cast

from rollstream.infra import KafkaConfig
from rollstream.infra.control import ControlWatcher
from rollstream.infra.threads import in_thread
from rollstream.producers.engines.base import Completion, Engine, EngineError, ReloadableEngine, capabilities_of
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import PolicyVersion, TrainerPosition

log = logging.getLogger(__name__)


def stamp_version(completion: Completion, version_at_start: int) -> int:
    """One completion's policy version (see the module docstring)."""
    if completion.version_spans:
        return min(span.version for span in completion.version_spans)
    return version_at_start if completion.policy_version is None else completion.policy_version


class PolicyFollower:
    """Follows the announced policy versions for one producer.

    `start`, `stamp` and `close` belong to the loop that called `start`; `policy_version` is a
    thread-safe read. With ``watch=False`` no version is followed (every sample gets the engine's version
    or 0). `on_position` gets, in the watcher thread, every trainer position on NS.control (the lag gate's
    pushed backpressure); NS.control is then read even with ``watch=False``.
    """

    def __init__(self, engine: Engine, config: KafkaConfig, control_topic: str, *, metrics: ProducerMetrics,
                 watch: bool = True, on_position: Callable[[TrainerPosition], None] | None = None) -> None:
        self._reloadable = cast(ReloadableEngine, engine) if capabilities_of(engine).reloads_weights else None
        self._metrics = metrics
        self._watch = watch
        self._watcher = (ControlWatcher(config, control_topic, on_version=self.on_announced if watch else None,
                                        on_superseded=self._on_superseded if watch else None,
                                        on_position=on_position)
                         if watch or on_position is not None else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wanted: PolicyVersion | None = None
        self._serving: PolicyVersion | None = None  # the announcement the engine serves (None: none loaded yet)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def start(self, catch_up_timeout: float) -> None:
        """Start following NS.control and wait (off-loop) up to `catch_up_timeout` s until what it held at
        startup was read, so the first samples carry the current version. Never raises for a slow topic:
        a warning says early samples may carry an older version."""
        self._loop = asyncio.get_running_loop()
        self._show_serving()
        if self._watcher is None:
            return
        self._watcher.start()
        if not await in_thread(self._watcher.wait_caught_up, catch_up_timeout, name="rollstream-policy-catch-up"):
            log.warning("%s not read to its end in time: early samples may carry an older policy version",
                        self._watcher.topic)

    @property
    def policy_version(self) -> int:
        """The version producers follow now: the newest run's latest on NS.control (0 before any). Thread-safe."""
        announced = self._watcher.policy_version if self._watcher is not None and self._watch else None
        return 0 if announced is None else announced

    @property
    def followed(self) -> tuple[int, int]:
        """The trainer run and version producers follow now, read together (0, 0 before any). Thread-safe."""
        announced = self._watcher.followed if self._watcher is not None and self._watch else None
        return (0, 0) if announced is None else (announced.run, announced.version)

    def stamp(self, completions: Sequence[Completion], version_at_start: int) -> list[int]:
        """The policy version of each completion (the oldest of its tokens), by the precedence in the
        module docstring."""
        return [stamp_version(c, version_at_start) for c in completions]

    async def close(self) -> None:
        """Stop following; a load in progress is cancelled (the engine keeps what it serves). Idempotent."""
        self._closed = True
        self._wanted = None
        if self._watcher is not None:
            self._watcher.stop()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def join(self, timeout: float) -> bool:
        """Block up to `timeout` s for the watcher thread to end (after `close`); True when it has."""
        return self._watcher is None or self._watcher.join(timeout)

    # -- loading announced weights ---------------------------------------------------------------

    def on_announced(self, version: PolicyVersion) -> None:
        """An announcement to follow (the watcher calls this from its thread for each one, in order): load
        it if the engine owns its weights and the version names some. Thread-safe; returns at once."""
        self._metrics.policy_run.set(version.run)
        if self._reloadable is None or not version.weights_path or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._want, version)
        except RuntimeError:
            pass  # the loop is closed: the producer is gone

    def _on_superseded(self, version: PolicyVersion) -> None:
        self._metrics.superseded_announcements.inc()

    def _want(self, version: PolicyVersion) -> None:
        if self._closed or self._loop is None:
            return
        self._wanted = version  # the watcher hands them over in order: the latest is the one to follow
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._load_newest(), name="rollstream-weights")

    def _serves(self, engine: ReloadableEngine, version: PolicyVersion) -> bool:
        """True when the engine serves `version` already: it loaded that very announcement, or, before
        any load, it was started with weights of that number."""
        if self._serving is None:
            return engine.policy_version == version.version
        return (self._serving.run, self._serving.run_id, self._serving.version) == (
            version.run, version.run_id, version.version)

    async def _load_newest(self) -> None:
        engine = self._reloadable
        while self._wanted is not None and engine is not None:
            version, self._wanted = self._wanted, None
            if self._serves(engine, version):
                self._serving = version
                continue
            try:
                loaded = await engine.reload(str(version.weights_path), version.version)
            except EngineError as exc:
                log.error("could not load policy version %d from %s; still serving version %s: %s",
                          version.version, version.weights_path, engine.policy_version, exc)
                self._count("failed")
                continue
            self._serving = version
            if loaded:
                self._count("loaded")

    def _count(self, result: str) -> None:
        self._metrics.weight_reloads.labels(result=result).inc()
        self._show_serving()

    def _show_serving(self) -> None:
        serving = self._reloadable.policy_version if self._reloadable is not None else None
        if serving is not None:
            self._metrics.show_weight_version(serving)
