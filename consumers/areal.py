"""Run AReaL's trainer (AReaL 1.0.4, ``areal/infra/workflow_executor.py``) on rollstream.

AReaL's trainer asks its rollout engine for each step's batch (``prepare_batch(dataloader, workflow=...,
should_accept_fn=..., group_size=...)``), and the engine's `WorkflowExecutor` keeps the accepted trajectories
in memory until then: a crash loses every one. Here the engine's executor is a `RollstreamExecutor`:

- **Producer half** (`RollstreamWorkflow`, `TrajectoryPublisher`): each trajectory a workflow returns (not
  None) is published as one ScoredGroup (`rollstream.consumers._areal_codec`, encoding ``rollstream.areal/1``,
  exact round trip, no pickle) and returned only once the broker acknowledged it (acks=all, idempotent).
  Every group is stamped with the trainer run it serves (``policy_run``). Generation stays AReaL's own: the
  executor keeps a real `WorkflowExecutor` running the wrapped workflow, its submissions bounded by
  `LagStaleness`: AReaL's formula with the trajectories accepted and not trained read from the records
  (the trainer group's lag on NS.rollouts) instead of an in-memory count, so it holds after a restart too.
- **Trainer half** (`RollstreamExecutor.prepare_batch`): takes exactly ``dataloader.batch_size`` groups (one
  rollstream step) and returns them decoded, as AReaL's executor returns its trajectories. The trainer's
  ``should_accept_fn`` runs on the trainer side as a filter (a rejected group is recorded in the step's
  manifest, ``filtered: areal: should_accept_fn rejected it``); so do staleness (``max_head_offpolicyness``
  versions behind the engine's version, counted from the oldest version of the trajectory's tokens) and the
  trainer run (a group generated under an older run is never trained).
- **Commit after training**: AReaL sets the engine's version to ``global_step + 1`` right after
  ``ppo_update`` (``areal/trainer/rl_trainer.py``); the step taken at version v is committed at the first call
  that sees the version past v (``resume()`` at the end of the step, after AReaL's checkpoint, else the next
  ``prepare_batch``). A crash before that leaves it uncommitted: the recovered run's first batch is the same batch.
- **Resume**: AReaL's recover calls ``staleness_manager.on_version_recovered(v)`` after loading the checkpoint
  of global step v - 1; `LagStaleness` hands it to `RollstreamExecutor.recover`, which moves the group to
  exactly after the step taken at version v - 1 (`RolloutConsumer.seek_to_step`; found in the group's
  manifests, which record each step's version) and begins a new trainer run (`PolicyAnnouncer`): producers
  follow it. Staleness is `ResumedStale` at v: a group a dead run generated entirely at versions up to v came
  from the checkpoint's weights or those before them, which the recovered run shares, so it is judged by its
  versions alone, and the steps the dead run took at versions up to v come back as recorded (the same batches).
  A dead run's group with a newer version is stale (those weights were lost with it); so is every group of a
  dead run when the trainer did not recover (AReaL without ``recover``: a new start from the base weights).

What the user changes: one import in the training script, above the trainer, and nothing else (no flag, no key
of AReaL's config)::

    import rollstream.consumers.areal_install  # noqa: F401  (AReaL's engines build a RollstreamExecutor)

That module calls `install()`, which replaces the name ``WorkflowExecutor`` in ``areal.infra.remote_inf_engine``
(what SPMD-mode engines, ``RemoteSGLangEngine`` / ``RemotevLLMEngine``, build in ``initialize``); `uninstall()`
puts AReaL's back. Not covered: AReaL's single-controller mode (its ``RolloutController`` builds no
``WorkflowExecutor`` through that name) and an actor with more than one data-parallel head (`initialize` raises).
Settings come from the environment (`ArealSettings.of`): ``ROLLSTREAM_BOOTSTRAP_SERVERS``,
``ROLLSTREAM_KAFKA_CONFIG``, ``ROLLSTREAM_NAMESPACE``, ``ROLLSTREAM_TRAINER_GROUP``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import areal.infra.remote_inf_engine as _remote
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import WorkflowExecutor
from rollstream.consumers._adapters import group_size_filter
from rollstream.consumers._areal_codec import ArealEncodingError, decode_trajectory
from rollstream.consumers._areal_publish import ArealSettings, RollstreamWorkflow, TrajectoryPublisher
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import RolloutConsumer
from rollstream.consumers._manifests import read_manifests
from rollstream.consumers.filters import FilterContext, GroupFilter, ResumedStale, failed_group
from rollstream.infra import PolicyAnnouncer, TopicNames
from rollstream.infra.lag import LagReader
from rollstream.schemas import PolicyVersion, RollstreamError, ScoredGroup

log = logging.getLogger(__name__)
__all__ = ["ArealEncodingError", "ArealSettings", "LagStaleness", "RollstreamExecutor", "RollstreamWorkflow",
           "TrajectoryPublisher", "install", "uninstall"]


class LagStaleness(StalenessManager):
    """AReaL's `StalenessManager` whose "accepted, not yet trained" is the trainer group's lag on NS.rollouts
    (read at most every ``lag_refresh_s``) less the records the waiting take would not take
    (`RolloutConsumer.skipped_waiting`), so capacity =
    ``min(max_concurrent - running, (max_staleness + 1) x consumer_batch_size - (lag + running))`` also after a
    restart; ``on_version_recovered`` resumes the executor (`RollstreamExecutor.recover`)."""

    def __init__(self, executor: RollstreamExecutor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.executor = executor

    def get_capacity(self) -> int:
        # Records the waiting take judged and would not take (a dead run's stale groups) will never be trained:
        # counted, they could fill the bound and stop generation for good.
        lag = max(0, self.executor.lag() - self.executor.consumer.skipped_waiting)
        with self.lock:
            running = self.rollout_stat.running
        concurrency = max(1, self.max_concurrent_rollouts) - running
        return min(concurrency, (self.max_staleness + 1) * max(1, self.consumer_batch_size) - (lag + running))

    def on_version_recovered(self, version: int) -> None:
        super().on_version_recovered(version)
        self.executor.recover(version)


class RollstreamExecutor:
    """AReaL's `WorkflowExecutor` surface (``initialize``, ``destroy``, ``submit``, ``wait``, ``prepare_batch``,
    ``pause``, ``resume``, ``get_capacity``, ``staleness_manager``) with `prepare_batch` taken from rollstream.

    ``submit``, ``wait``, ``wait_for_task`` and ``rollout_batch`` (AReaL's evaluation and offline paths) are the
    inner executor's, unpublished. Not thread-safe: the trainer's thread calls it (AReaL's does too). No network
    in ``__init__``; ``initialize`` starts nothing on the broker either (the consumer connects on the first take).
    """

    def __init__(self, config: Any, inference_engine: Any, staleness_manager: StalenessManager | None = None, *,
                 settings: ArealSettings | None = None) -> None:
        self.config, self.inference_engine = config, inference_engine
        self.settings = s = settings or ArealSettings.of()
        self.max_staleness = config.max_head_offpolicyness
        kafka = s.kafka(f"rollstream-areal-trainer-{s.group}")
        self.publisher = TrajectoryPublisher(s)
        self.announcer = PolicyAnnouncer(kafka, TopicNames(s.namespace))
        self._accept: list[Callable[[dict[str, Any]], bool] | None] = [None]
        self.staleness = ResumedStale()  # resumed_at: set by `recover`
        filters: list[GroupFilter] = [failed_group, self.staleness, self._should_accept,
                                      group_size_filter(None, trainer="AReaL", setting="gconfig.n_samples")]
        self.consumer = RolloutConsumer(config=kafka, group_id=s.group, namespace=s.namespace, filters=filters,
                                        max_staleness=self.max_staleness, timeout=s.kafka_timeout_s,
                                        announcer=self.announcer)
        self._lag_reader = LagReader(kafka)
        self._lag: tuple[float, int] | None = None
        self._given_manager = staleness_manager
        self._inner: WorkflowExecutor | None = None
        self._inputs: Iterator[dict[str, Any]] | None = None
        self._handed: tuple[Batch, int] | None = None  # the step handed over, and the version it was taken at
        self._announced: int | None = None

    # -- AReaL's WorkflowExecutor surface ----------------------------------------------------------------

    def initialize(self, logger: Any = None, train_data_parallel_size: int | None = None) -> None:
        """Build the inner `WorkflowExecutor` (AReaL's, generating with `LagStaleness`) and start its threads.

        Raises:
            RollstreamError: more than one data-parallel head (``train_data_parallel_size`` > 1): each head's
                executor would take its own steps from the one trainer group and begin a trainer run fencing the
                others'; not supported yet.
        """
        if (train_data_parallel_size or 1) > 1:
            raise RollstreamError(f"rollstream.consumers.areal serves one data-parallel head; AReaL asked for "
                                  f"{train_data_parallel_size} (the actor's dp_size): each head would take its own "
                                  "steps from the one trainer group. Run the actor with dp_size 1 (tensor or pipeline "
                                  "parallelism are fine), or AReaL's own executor")
        manager = self._given_manager or LagStaleness(
            self, version_provider=self.inference_engine,
            max_concurrent_rollouts=max(1, self.config.max_concurrent_rollouts or self.config.consumer_batch_size),
            consumer_batch_size=max(1, self.config.consumer_batch_size), max_staleness=self.max_staleness)
        self._inner = WorkflowExecutor(self.config, self.inference_engine, staleness_manager=manager)
        self._inner.initialize(logger=logger, train_data_parallel_size=train_data_parallel_size)

    @property
    def inner(self) -> WorkflowExecutor:
        if self._inner is None:
            raise RollstreamError("RollstreamExecutor.initialize() must be called before scheduling rollouts")
        return self._inner

    @property
    def staleness_manager(self) -> StalenessManager:
        return self.inner.staleness_manager

    def get_capacity(self) -> int:
        return self.inner.get_capacity()

    def submit(self, data: dict[str, Any], workflow: Any, should_accept_fn: Any = None, task_id: int | None = None,
               is_eval: bool = False) -> int:
        return self.inner.submit(data, workflow, should_accept_fn, task_id, is_eval)

    def wait(self, count: int, timeout: float | None = None, raise_timeout: bool = True) -> list[Any]:
        return self.inner.wait(count, timeout, raise_timeout)

    def wait_for_task(self, task_id: int, timeout: float | None = None, raise_timeout: bool = True) -> Any:
        return self.inner.wait_for_task(task_id, timeout, raise_timeout)

    def rollout_batch(self, data: list[dict[str, Any]], workflow: Any) -> list[dict[str, Any]]:
        return self.inner.rollout_batch(data, workflow)

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        """AReaL's resume (the end of a training step): commit the step if it was trained, then resume generating.
        Blocks until committed; raises what `commit_trained` raises."""
        self.commit_trained(only_if_trained=True)
        self.inner.resume()

    def is_paused(self) -> bool:
        return self.inner.is_paused()

    def prepare_batch(self, dataloader: Any, workflow: Any, should_accept_fn: Any = None,
                      dynamic_bs: bool = False) -> list[dict[str, Any]]:
        """One training step's trajectories: exactly ``dataloader.batch_size`` groups from NS.rollouts, decoded.

        First commits the previous step if it was trained (the engine's version moved past the one it was
        taken at); keeps AReaL's generation going from `dataloader` with `workflow` (published, bounded by
        `LagStaleness`). Blocks until the step is there, at most ``take_timeout_s``; nothing is committed
        when it returns (`resume` or the next call commits it). `dynamic_bs` is ignored: always exactly the batch.

        Raises:
            RollstreamError: the previous step was not trained (the engine's version did not move).
            TakeTimeout: ``take_timeout_s`` passed; RunSupersededError: a newer trainer run began;
            ArealEncodingError: a group rollstream cannot read as a trajectory.
        """
        self.commit_trained(only_if_trained=True)
        if self._handed is not None:
            raise RollstreamError(f"AReaL asked for the batch after rollstream step {self._handed[0].step} while its "
                                  f"engine's version is still {self._handed[1]}: the step was not trained, so it is "
                                  "not committed; AReaL sets the version after ppo_update (set_version)")
        self._accept[0] = should_accept_fn if callable(should_accept_fn) else None
        if self._inputs is None:
            self._inputs = (item for batch in _cycle(dataloader) for item in batch)
        version = int(self.inference_engine.get_version())
        self._announce(version)
        batch = self._take(dataloader.batch_size, workflow, version)
        self._handed = (batch, version)
        return [decode_trajectory(g) for g in batch.groups]

    def destroy(self) -> None:
        """Stop generating, close the consumer, publisher and announcer; what was handed over and not committed
        comes back to the next run. Idempotent."""
        if self._inner is not None:
            self._inner.destroy()
        self.consumer.close()
        self.publisher.close()
        self.announcer.close()
        self._lag_reader.close()

    # -- rollstream's side -------------------------------------------------------------------------------

    def commit_trained(self, *, only_if_trained: bool = False) -> int | None:
        """Commit the step handed over; returns its step number (None: nothing to commit). With
        `only_if_trained`, only once the engine's version moved past the one it was taken at. Blocks until
        committed.

        Raises:
            RunSupersededError: a newer trainer run began. CommitError: the commit failed (retriable).
        """
        if self._handed is None:
            return None
        batch, version = self._handed
        if only_if_trained and int(self.inference_engine.get_version()) <= version:
            return None
        self.consumer.commit(batch)
        self._handed, self._lag = None, None
        log.info("AReaL trained rollstream step %d (%d groups, version %d): committed", batch.step, len(batch.groups),
                 version)
        return batch.step

    def recover(self, version: int) -> int | None:
        """AReaL recovered the checkpoint of global step ``version - 1``: continue exactly after the step taken at
        that version (the newest such in the group's manifests; None, and a warning, if there is none), as a new
        trainer run that shares the older runs' versions up to `version` (`ResumedStale`): the steps recorded after
        it come back as recorded while their groups' versions are at most `version`. Blocks until the position is
        committed and the run announced.

        Raises:
            what `RolloutConsumer.seek_to_step` and `PolicyAnnouncer.announce` raise.
        """
        self._handed = None
        self.staleness.resumed_at = version
        names = TopicNames(self.settings.namespace)
        steps = [m.step for m in read_manifests(self.consumer.config, names.steps, self.settings.group,
                                                timeout=self.settings.kafka_timeout_s)
                 if m.policy_version == version - 1]
        self._announce(version)
        if not steps:
            log.warning("group %s has no step taken at version %d: continuing from its committed position",
                        self.settings.group, version - 1)
            return None
        self.consumer.seek_to_step(steps[-1])
        log.info("AReaL recovered version %d: continuing after rollstream step %d", version, steps[-1])
        return steps[-1]

    def lag(self) -> int:
        """The trainer group's lag on NS.rollouts (published, not committed), at most ``lag_refresh_s`` old."""
        now = time.monotonic()
        if self._lag is None or now - self._lag[0] >= self.settings.lag_refresh_s:
            lag = self._lag_reader.group_lag(self.settings.group, TopicNames(self.settings.namespace).rollouts,
                                             timeout=min(10.0, self.settings.kafka_timeout_s)).total
            self._lag = (now, lag)
        return self._lag[1]

    def _announce(self, version: int) -> None:
        if self._announced == version:
            return
        written = self.announcer.announce(PolicyVersion(version, metadata={"trainer": "areal"}))
        self._announced, self.publisher.policy_run = version, written.run

    def _take(self, n: int, workflow: Any, version: int) -> Batch:
        started, limit = time.monotonic(), self.settings.take_timeout_s
        wrapped = workflow if isinstance(workflow, RollstreamWorkflow) else RollstreamWorkflow(workflow,
                                                                                               self.publisher)
        while True:
            self._generate(wrapped, n)
            wait = self.settings.poll_interval_s
            if limit is not None:
                wait = max(0.0, min(wait, started + limit - time.monotonic()))
            batch = self.consumer.poll_batch(n, wait, commit=False, policy_version=version)
            if batch is not None:
                return batch
            if limit is not None and time.monotonic() - started >= limit:
                raise self.consumer.timeout_error(n, limit)

    def _generate(self, workflow: RollstreamWorkflow, n: int) -> None:
        """Submit up to `n` prompts to AReaL's executor while `LagStaleness` has room (AReaL's own overlap)."""
        if self._inputs is None or self._inner is None:
            return
        for _ in range(max(0, min(n, self._inner.get_capacity()))):
            self._inner.submit(next(self._inputs), workflow)

    def _should_accept(self, group: ScoredGroup, context: FilterContext) -> str | None:
        accept = self._accept[0]
        if accept is None or group.metadata.get("areal.encoding") is None:
            return None
        return None if accept(decode_trajectory(group)) else "areal: should_accept_fn rejected it"


def _cycle(dataloader: Any) -> Iterator[Any]:
    while True:
        yield from dataloader


def install() -> None:
    """Make AReaL's SPMD engines (``RemoteInfEngine.initialize``) build a `RollstreamExecutor`: replaces the name
    ``WorkflowExecutor`` in ``areal.infra.remote_inf_engine`` (AReaL 1.0.4). Idempotent."""
    _remote.WorkflowExecutor = RollstreamExecutor


def uninstall() -> None:
    """Put AReaL's own `WorkflowExecutor` back. Idempotent."""
    _remote.WorkflowExecutor = WorkflowExecutor
