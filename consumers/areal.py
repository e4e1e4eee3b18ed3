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
  that sees the version past v (``resume()`` at the end of the step, else the next ``prepare_batch``). A crash
  before that leaves it uncommitted: the next run's first batch is the same batch.
- **Resume**: AReaL's recover calls ``staleness_manager.on_version_recovered(v)`` after loading the checkpoint
  of global step v - 1; `LagStaleness` hands it to `RollstreamExecutor.recover`, which moves the group to
  exactly after the step taken at version v - 1 (`RolloutConsumer.seek_to_step`; found in the group's
  manifests, which record each step's version) and begins a new trainer run (`PolicyAnnouncer`): producers
  follow it, and what a dead run generated is filtered as stale.

What the user changes: nothing in the training script or config but the executor's class, one line before the
trainer is built::

    import rollstream.consumers.areal as rs; rs.install()   # AReaL's engines build a RollstreamExecutor

`install()` replaces the name ``WorkflowExecutor`` in ``areal.infra.remote_inf_engine`` (what SPMD-mode engines,
``RemoteSGLangEngine`` / ``RemotevLLMEngine``, build in ``initialize``); `uninstall()` puts AReaL's back.
Settings come from the environment (`ArealSettings.of`): ``ROLLSTREAM_BOOTSTRAP_SERVERS``,
``ROLLSTREAM_KAFKA_CONFIG``, ``ROLLSTREAM_NAMESPACE``, ``ROLLSTREAM_TRAINER_GROUP``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import areal.infra.remote_inf_engine as _remote
from areal.api import RolloutWorkflow
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import WorkflowExecutor
from rollstream.consumers._adapters import group_size_filter
from rollstream.consumers._areal_codec import ArealEncodingError, decode_trajectory, encode_trajectory
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from rollstream.consumers._manifests import read_manifests
from rollstream.consumers._verl_publish import AckedPublisher
from rollstream.consumers.filters import FilterContext, GroupFilter, failed_group, stale
from rollstream.infra import KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.infra.config import ConfigError
from rollstream.infra.lag import LagReader
from rollstream.schemas import PolicyVersion, RollstreamError, ScoredGroup, encode, make_group_id

log = logging.getLogger(__name__)
__all__ = ["ArealEncodingError", "ArealSettings", "LagStaleness", "RollstreamExecutor", "RollstreamWorkflow",
           "TrajectoryPublisher", "install", "uninstall"]


@dataclass(frozen=True)
class ArealSettings:
    """rollstream's side of an AReaL run. `of` reads the environment."""

    bootstrap_servers: str | None = None
    kafka_config: str | None = None
    namespace: str = "rollstream"
    group: str = DEFAULT_GROUP
    take_timeout_s: float | None = None  # None: wait
    poll_interval_s: float = 0.5
    lag_refresh_s: float = 0.5
    kafka_timeout_s: float = 30.0
    producer_id: str = field(default_factory=lambda: f"areal-{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        if not self.namespace or not self.group:
            raise ConfigError(f"namespace={self.namespace!r} and group={self.group!r} must be non-empty")
        if self.poll_interval_s <= 0 or self.kafka_timeout_s <= 0 or self.lag_refresh_s < 0:
            raise ConfigError(f"poll_interval_s={self.poll_interval_s} and kafka_timeout_s={self.kafka_timeout_s} "
                              f"must be > 0, lag_refresh_s={self.lag_refresh_s} >= 0")

    @classmethod
    def of(cls, env: dict[str, str] | None = None) -> ArealSettings:
        """From ``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``ROLLSTREAM_KAFKA_CONFIG``, ``ROLLSTREAM_NAMESPACE`` and
        ``ROLLSTREAM_TRAINER_GROUP`` (`env`, default the process environment); unset ones keep their defaults."""
        source = os.environ if env is None else env
        names = {"bootstrap_servers": "ROLLSTREAM_BOOTSTRAP_SERVERS", "kafka_config": "ROLLSTREAM_KAFKA_CONFIG",
                 "namespace": "ROLLSTREAM_NAMESPACE", "group": "ROLLSTREAM_TRAINER_GROUP"}
        return cls(**{k: source[v] for k, v in names.items() if source.get(v)})

    def kafka(self, client_id: str) -> KafkaConfig:
        return KafkaConfig.load(self.bootstrap_servers, Path(self.kafka_config) if self.kafka_config else None,
                                client_id=client_id)


class TrajectoryPublisher:
    """Publishes AReaL trajectories to NS.rollouts, any number in flight (`AckedPublisher`). Thread-safe; no
    network before the first publish. `policy_run`: the trainer run stamped on each group (set by the trainer)."""

    def __init__(self, settings: ArealSettings) -> None:
        self.settings = settings
        kafka = settings.kafka(settings.producer_id)
        self._publisher = AckedPublisher(kafka.producer(), TopicNames(settings.namespace).rollouts,
                                         settings.kafka_timeout_s)
        self.policy_run = 0
        self._count = 0

    def send(self, traj: dict[str, Any]) -> tuple[str, concurrent.futures.Future[None]]:
        """Encode and queue `traj` (never waits for the broker); returns its group id and a future resolved
        when acknowledged, or failed with `PublishFailed`.

        Raises:
            ArealEncodingError: `traj` cannot be carried. PublishFailed: librdkafka refused it.
        """
        self._count += 1
        key = f"{self.settings.producer_id}.r{self.policy_run}.{self._count}"
        group = encode_trajectory(traj, group_id=make_group_id(key, 0), prompt_id=key,
                                  producer_id=self.settings.producer_id, policy_run=self.policy_run)
        return group.group_id, self._publisher.send(group.group_id, encode(group))

    async def publish(self, traj: dict[str, Any]) -> str:
        """Publish `traj`; returns its group id once the broker acknowledged it (at most ``kafka_timeout_s``).

        Raises:
            PublishFailed: not acknowledged in time; ArealEncodingError.
        """
        group_id, acked = self.send(traj)
        await asyncio.wrap_future(acked)
        return group_id

    def close(self) -> None:
        """Wait up to ``kafka_timeout_s`` for what is in flight, then stop. Idempotent."""
        self._publisher.close(self.settings.kafka_timeout_s)


class RollstreamWorkflow(RolloutWorkflow):
    """AReaL's `RolloutWorkflow` `inner`, whose trajectories are published before they are returned.

    ``arun_episode`` returns what `inner` returned (None: rejected, nothing published) once the broker
    acknowledged it. Raises what `inner` raises, `PublishFailed` or `ArealEncodingError` (AReaL's executor
    counts a raising episode as rejected)."""

    def __init__(self, inner: Any, publisher: TrajectoryPublisher) -> None:
        self.inner, self.publisher = inner, publisher

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        traj = await self.inner.arun_episode(engine, data)
        if traj is None:
            return None
        await self.publisher.publish(traj)
        return traj


class LagStaleness(StalenessManager):
    """AReaL's `StalenessManager` whose "accepted, not yet trained" is the trainer group's lag on NS.rollouts
    (read at most every ``lag_refresh_s``), so capacity =
    ``min(max_concurrent - running, (max_staleness + 1) x consumer_batch_size - (lag + running))`` also after a
    restart; ``on_version_recovered`` resumes the executor (`RollstreamExecutor.recover`)."""

    def __init__(self, executor: RollstreamExecutor, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.executor = executor

    def get_capacity(self) -> int:
        lag = self.executor.lag()
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
        filters: list[GroupFilter] = [failed_group, stale, self._should_accept,
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
        """Build the inner `WorkflowExecutor` (AReaL's, generating with `LagStaleness`) and start its threads."""
        dp = max(1, train_data_parallel_size or 1)
        manager = self._given_manager or LagStaleness(
            self, version_provider=self.inference_engine,
            max_concurrent_rollouts=max(1, (self.config.max_concurrent_rollouts or self.config.consumer_batch_size)
                                        // dp),
            consumer_batch_size=max(1, self.config.consumer_batch_size // dp), max_staleness=self.max_staleness)
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
        trainer run. Blocks until the position is committed and the run announced.

        Raises:
            what `RolloutConsumer.seek_to_step` and `PolicyAnnouncer.announce` raise.
        """
        self._handed = None
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
    _remote.WorkflowExecutor = RollstreamExecutor  # type: ignore[misc, assignment]


def uninstall() -> None:
    """Put AReaL's own `WorkflowExecutor` back. Idempotent."""
    _remote.WorkflowExecutor = WorkflowExecutor  # type: ignore[misc]
