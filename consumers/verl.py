"""Run verl's fully-async trainer (verl 0.9.1, ``verl/experimental/fully_async_policy``) on rollstream.

Run it as verl's own entry point, with rollstream's settings next to verl's::

    python -m rollstream.consumers.verl <verl's fully_async_ppo_trainer overrides> \\
        +rollstream.namespace=gsm8k +rollstream.group=verl-trainer    # `rollstream topics create` first

It is ``fully_async_main`` with the rollouter and trainer subclassed (``rollstream.consumers._verl_runner``), no
fork of verl. verl's ``MessageQueue`` (a Ray actor holding a ``deque(maxlen=max_queue_size)`` that drops the
oldest sample when full and loses everything on a crash) is replaced by NS.rollouts:

- The rollouter's ``put_sample`` publishes each ``RolloutSample`` (one prompt, ``rollout.n`` responses) as one
  ScoredGroup (`rollstream.consumers._verl_codec`, encoding ``rollstream.verl/1``, no pickle on the wire) and
  returns when the broker acknowledged it (acks=all, idempotent; the puts verl runs concurrently are all in
  flight at once, each waiting for its own acknowledgement only). Nothing is ever dropped: when the queue
  is "full" the rollouter pauses, as verl does, but "queue size" is now the trainer group's lag on
  NS.rollouts (`VerlRolloutQueue.get_queue_size`). The lag also counts the step being trained (taken, not
  committed yet), so the rollouter's ``max_queue_size`` is raised by ``required_samples`` to pause where
  verl's deque would have been full.
- The trainer's ``get_sample`` takes exactly ``required_samples`` groups per step (one rollstream step) and
  hands them over one by one as verl's ``_get_samples_from_queue`` expects (pickle bytes that verl's
  ``ray.cloudpickle.loads`` turns into the RolloutSample rebuilt from the record, its tensors as numpy arrays
  (`_verl_codec.handover`): verl's own in-process hand-over, never written anywhere).
- The step is committed right after verl's ``_fit_update_actor`` returned (fully_async_trainer.py:591):
  the earliest point where verl trained on it, before its weights sync, checkpoint and the next take. A crash
  before that leaves it uncommitted (a resumed job judges it afresh, see below). A checkpoint of version k stores
  the last committed step in ``global_step_k/rollstream.json``; loading it seeks there
  (`RolloutConsumer.seek_to_step`), so a resumed trainer continues exactly after k.
- Each trainer process is one trainer run (`rollstream.infra.runs`): it announces verl's param version at
  every weight sync (``PolicyVersion(current_param_version)``, a resumed run counts from its checkpoint's
  version again and supersedes the old run), and the broker refuses a replaced trainer's commits. It hands
  its run to the rollouter at each sync (the first, verl's "param sync before fit", comes before the rollouter
  generates), and the rollouter stamps it on every group (``policy_run``).
- Staleness (``max_staleness``) is measured against that version; a group's weight versions are the
  trajectory's ``min_global_steps`` and ``max_global_steps``. A group generated under an older trainer run
  is never trained, whatever its versions (after a resume they share numbers, not weights): it is filtered
  as ``stale: generated under trainer run R, ...`` and recorded in the step's manifest. So is a group more
  than ``max_staleness`` versions behind, or ahead of the trainer's version. A recorded step the dead run
  took after the checkpoint is not taken again as recorded (its groups are judged afresh). verl's rollouter
  cannot regenerate a filtered group: the prompts a dead run had generated but not trained by the checkpoint
  are not trained in this epoch, as with verl's own queue (whose in-flight samples a crash loses).
- The rollouter's end of data (``put_sample(None)``) is published as a failed group with metadata
  ``verl.end``; the trainer records it as filtered (``end_of_stream``) and returns verl's end signal once no
  full step is left.
- verl's metrics get ``rollstream/lag``, ``rollstream/take_s``, ``rollstream/commit_s``, the step's
  dispositions (``rollstream/taken_total``, ``filtered``, ``requeued``, ``duplicate``, ``undecodable``) and
  ``rollstream/staleness_mean`` / ``_max``.

Settings (`VerlSettings.of`): the ``rollstream`` section of verl's config, else environment variables:
``bootstrap_servers`` / ``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``kafka_config`` / ``ROLLSTREAM_KAFKA_CONFIG`` (a
librdkafka properties file), ``namespace`` / ``ROLLSTREAM_NAMESPACE``, ``group`` / ``ROLLSTREAM_TRAINER_GROUP``,
``take_timeout_s`` (default: wait), ``poll_interval_s`` (1.0), ``max_staleness`` (default: derived from verl's
``async_training.staleness_threshold`` by `staleness_limit`), ``dynamic_sampling`` (default off: verl trains
all-equal groups), ``lag_refresh_s`` (0.5: how old a lag the rollouter's pause may act on), ``kafka_timeout_s`` (30).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rollstream.consumers._adapters import StepMetrics, group_size_filter
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from rollstream.consumers._verl_codec import END_KEY, RolloutSample, decode_sample, handover
from rollstream.consumers.filters import FilterContext, all_rewards_equal, failed_group, stale
from rollstream.infra import KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.infra.config import ConfigError
from rollstream.infra.threads import ThreadPool
from rollstream.schemas import PolicyVersion, RollstreamError, ScoredGroup

log = logging.getLogger(__name__)
POSITION_FILE = "rollstream.json"  # in verl's global_step_<k> checkpoint folder
VERL_STALENESS_THRESHOLD = 0.1  # async_training.staleness_threshold in verl 0.9.1's fully_async_ppo_trainer.yaml


def staleness_limit(staleness_threshold: float) -> int:
    """The ``max_staleness`` that matches verl's ``async_training.staleness_threshold`` s: ``ceil(s) + 1``.

    verl's rollouter pauses once it started ``(1 + s) x`` the samples of one param version (``required_samples
    x trigger_parameter_sync_step``) since the last weight sync, counting those still queued or generating. So
    a sample started under version v waits behind at most ``(1 + s)`` versions' worth and is trained by version
    ``v + ceil(s)`` when samples finish in the order they started; one version more allows a generation that
    finishes after the next sync (partial rollouts, long tails). verl itself drops nothing: a group staler than
    this is what its pause should have prevented (or a dead run's), and is filtered and recorded.

    Raises:
        ConfigError: `staleness_threshold` below 0 (verl refuses it too).
    """
    if staleness_threshold < 0:
        raise ConfigError(f"async_training.staleness_threshold={staleness_threshold} must be >= 0")
    return math.ceil(staleness_threshold) + 1


@dataclass(frozen=True)
class VerlSettings:
    """rollstream's side of a verl run (the module docstring lists where each comes from)."""

    bootstrap_servers: str | None = None
    kafka_config: str | None = None
    namespace: str = "rollstream"
    group: str = DEFAULT_GROUP
    take_timeout_s: float | None = None
    poll_interval_s: float = 1.0
    max_staleness: int | None = None
    dynamic_sampling: bool = False
    lag_refresh_s: float = 0.5
    kafka_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.namespace or not self.group:
            raise ConfigError(f"rollstream.namespace={self.namespace!r} and rollstream.group={self.group!r} must "
                              "be non-empty")
        if self.poll_interval_s <= 0 or self.lag_refresh_s < 0 or self.kafka_timeout_s <= 0:
            raise ConfigError(f"rollstream.poll_interval_s={self.poll_interval_s} and kafka_timeout_s="
                              f"{self.kafka_timeout_s} must be > 0, lag_refresh_s={self.lag_refresh_s} >= 0")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"rollstream.max_staleness={self.max_staleness} must be >= 0 (or unset: derived from "
                              "verl's async_training.staleness_threshold)")

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> VerlSettings:
        """From verl's ``rollstream`` config section (a dict or DictConfig; None: none), then the environment.

        Raises:
            ConfigError: an unknown key (named), or a bad value.
        """
        given = dict(section or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ConfigError(f"unknown rollstream setting(s) {unknown} in verl's config; known: {sorted(known)}")
        env = {"bootstrap_servers": "ROLLSTREAM_BOOTSTRAP_SERVERS", "kafka_config": "ROLLSTREAM_KAFKA_CONFIG",
               "namespace": "ROLLSTREAM_NAMESPACE", "group": "ROLLSTREAM_TRAINER_GROUP"}
        for name, var in env.items():
            if given.get(name) is None and os.environ.get(var):
                given[name] = os.environ[var]
        return cls(**{k: v for k, v in given.items() if v is not None})

    def kafka(self, client_id: str) -> KafkaConfig:
        return KafkaConfig.load(self.bootstrap_servers, Path(self.kafka_config) if self.kafka_config else None,
                                client_id=client_id)


def end_of_stream(seen: list[bool]):  # noqa: ANN201 - a GroupFilter
    """The filter that recognises the rollouter's end marker (and notes it in `seen`)."""

    def verl_end(group: ScoredGroup, context: FilterContext) -> str | None:
        if group.metadata.get(END_KEY):
            seen.append(True)
            return "end_of_stream: verl's rollouter finished its data"
        return None

    return verl_end


class VerlTrainerQueue:
    """verl's ``MessageQueueClient`` as the trainer uses it, on a `RolloutConsumer` (and one trainer run).

    ``get_sample`` (async) hands over one RolloutSample per call, a step of `groups_per_step` taken at once;
    `commit_trained` commits it. Every Kafka call runs in the one ``rollstream-verl-trainer`` thread (the
    consumer is not thread-safe); the async methods never block the trainer's event loop, the sync ones
    (`commit_trained`, `announce`, `save_position`, `resume_from`) block until done. No network in
    ``__init__``: the consumer starts on the first take or seek. `max_staleness` is the settings', else
    `staleness_limit` of verl's `staleness_threshold`.
    """

    def __init__(self, settings: VerlSettings, *, groups_per_step: int, group_size: int | None,
                 staleness_threshold: float = VERL_STALENESS_THRESHOLD) -> None:
        if groups_per_step < 1:
            raise ConfigError(f"groups_per_step={groups_per_step}: verl's required_samples must be >= 1")
        s = self.settings = settings
        self.groups_per_step = groups_per_step
        self.max_staleness = staleness_limit(staleness_threshold) if s.max_staleness is None else s.max_staleness
        kafka = s.kafka(f"rollstream-verl-trainer-{s.group}")
        self._ended: list[bool] = []
        filters = [end_of_stream(self._ended), failed_group, *([all_rewards_equal] if s.dynamic_sampling else []),
                   stale, group_size_filter(group_size, trainer="verl", setting="actor_rollout_ref.rollout.n")]
        self.announcer = PolicyAnnouncer(kafka, TopicNames(s.namespace))
        self.consumer = RolloutConsumer(config=kafka, group_id=s.group, namespace=s.namespace, filters=filters,
                                        max_staleness=self.max_staleness, timeout=s.kafka_timeout_s,
                                        announcer=self.announcer)
        self._thread = ThreadPool("rollstream-verl-trainer", 1)
        self._ready: deque[RolloutSample] = deque()
        self._handed: Batch | None = None
        self.version: int | None = None
        self.last_committed_step: int | None = None
        self._metrics: dict[str, float] = {}

    # -- verl's MessageQueueClient surface (message_queue.py:183-242) ------------------------------------

    async def get_sample(self) -> tuple[bytes | None, int]:
        """The next sample of the current step, as verl's queue returns it: ``(pickled RolloutSample
        (`handover`), samples left in this step)``, or ``(None, 0)`` once the rollouter ended and no full step is left.
        Blocks (off the loop) until a whole step is there, at most ``take_timeout_s``.

        Raises:
            TakeTimeout: ``take_timeout_s`` passed.
            RollstreamError: a new step was asked for before the last one was committed (the trainer's commit
                hook is missing).
        """
        if not self._ready:
            if self._handed is not None:
                raise RollstreamError(f"verl asked for step {self._handed.step + 1} before step {self._handed.step} "
                                      "was committed: run verl through rollstream.consumers.verl (its trainer "
                                      "commits after _fit_update_actor) or call commit_trained()")
            batch = await self._thread.run(self._take_step)
            if batch is None:
                return None, 0
            self._ready.extend(await self._thread.run(lambda: [decode_sample(g) for g in batch.groups]))
            self._handed = batch
        # verl's trainer unpickles what get_sample returns (fully_async_trainer.py:439): an in-process hand-over.
        return handover(self._ready.popleft()), len(self._ready)

    async def get_queue_size(self) -> int:
        """Groups on NS.rollouts the trainer group has not committed (its lag, read at most 10 s)."""
        return await self._thread.run(self._lag)

    def get_queue_size_sync(self) -> int:
        return self._thread.submit(self._lag).result()

    async def get_statistics(self) -> dict[str, Any]:
        size = await self.get_queue_size()
        return {"queue_size": size, "total_produced": 0, "total_consumed": self.consumer.next_step
                * self.groups_per_step, "dropped_samples": 0, "max_queue_size": 0}

    async def clear_queue(self) -> None:
        """Nothing to clear: what is not committed stays on NS.rollouts for the next run (on purpose)."""

    async def shutdown(self) -> None:
        self.close()

    # -- the trainer's hooks (rollstream.consumers._verl_runner) ---------------------------------------

    def commit_trained(self) -> int:
        """Commit the step handed over: verl trained on it. Blocks until committed; returns its step.

        Raises:
            RollstreamError: nothing handed over, or not all of it was read.
            RunSupersededError: a newer trainer run began.
            CommitError: the commit failed.
        """
        if self._handed is None or self._ready:
            raise RollstreamError(f"commit_trained: {'no step was handed over' if self._handed is None else ''}"
                                  f"{len(self._ready)} sample(s) of the step not read by verl; nothing committed")
        batch, started = self._handed, time.monotonic()
        self._thread.submit(self.consumer.commit, batch).result()
        self._handed, self.last_committed_step = None, batch.step
        self._metrics["rollstream/commit_s"] = time.monotonic() - started
        log.info("verl trained rollstream step %d (%d groups): committed", batch.step, len(batch.groups))
        return batch.step

    def announce(self, version: int) -> int:
        """verl synced its weights as param version `version`: announce it as this trainer run's, and return
        the run's number (the run begins at its first announcement, if not before). Blocks until written.

        Raises:
            RunSupersededError: a newer trainer run began. KafkaIOError: not written in ``kafka_timeout_s``.
        """
        self.version = version
        written = self._thread.submit(self.announcer.announce, PolicyVersion(version, metadata={"trainer": "verl"}),
                                      timeout=self.settings.kafka_timeout_s).result()
        return written.run

    def metrics(self) -> dict[str, float]:
        """rollstream's metrics of the last step (for verl's metrics dict), then cleared."""
        out, self._metrics = self._metrics, {}
        return out

    def save_position(self, folder: str | os.PathLike[str]) -> None:
        """Store the last committed step in verl's checkpoint `folder` (``rollstream.json``)."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        record = {"step": self.last_committed_step, "namespace": self.settings.namespace, "group": self.settings.group}
        (Path(folder) / POSITION_FILE).write_text(json.dumps(record))

    def resume_from(self, folder: str | os.PathLike[str] | None) -> int | None:
        """Continue exactly after the step stored in verl's checkpoint `folder` (None, or no file: from the
        group's committed position). Blocks until the position is committed. Returns the step, or None.

        Raises:
            RollstreamError: the file names another namespace or group; what `seek_to_step` raises.
        """
        path = Path(folder) / POSITION_FILE if folder else None
        if path is None or not path.exists():
            if folder:
                log.warning("verl checkpoint %s has no %s: continuing from the group's committed position", folder,
                            POSITION_FILE)
            return None
        record = json.loads(path.read_text())
        if (record["namespace"], record["group"]) != (self.settings.namespace, self.settings.group):
            raise RollstreamError(f"{path} was saved for namespace {record['namespace']!r} group {record['group']!r}, "
                                  f"not {self.settings.namespace!r} / {self.settings.group!r}")
        if record["step"] is None:
            return None
        self._thread.submit(self.consumer.seek_to_step, record["step"]).result()
        self.last_committed_step = record["step"]
        log.info("resumed from %s: continuing after rollstream step %d", path, record["step"])
        return int(record["step"])

    def close(self) -> None:
        """Close the consumer and the announcer; what was handed over and not committed comes back to the next
        run. Idempotent."""
        self._thread.submit(self.consumer.close).result()
        self._thread.submit(self.announcer.close).result()
        self._thread.retire()

    # -- in the rollstream-verl-trainer thread ----------------------------------------------------------

    def _take_step(self) -> Batch | None:
        started = time.monotonic()
        limit = self.settings.take_timeout_s
        while True:
            wait = self.settings.poll_interval_s
            if limit is not None:
                wait = max(0.0, min(wait, started + limit - time.monotonic()))
            batch = self.consumer.poll_batch(self.groups_per_step, wait, commit=False, policy_version=self.version)
            if batch is not None:
                self._note_take(batch, time.monotonic() - started)
                return batch
            if self._ended:
                log.info("verl's rollouter ended and fewer than %d groups are left: end of training",
                         self.groups_per_step)
                return None
            if limit is not None and time.monotonic() - started >= limit:
                raise self.consumer.timeout_error(self.groups_per_step, limit)

    def _note_take(self, batch: Batch, waited_s: float) -> None:
        m = StepMetrics.of(batch, self.version or 0, self.consumer.estimated_lag())
        self._metrics.update({"rollstream/lag": float(m.lag), "rollstream/take_s": waited_s,
                              **{f"rollstream/{kind}_total": float(n) for kind, n in m.counts.items()}})
        if m.staleness:
            self._metrics["rollstream/staleness_mean"] = m.staleness_mean
            self._metrics["rollstream/staleness_max"] = float(m.staleness_max)

    def _lag(self) -> int:
        return self.consumer.lag(timeout=min(10.0, self.settings.kafka_timeout_s)).total


if __name__ == "__main__":  # python -m rollstream.consumers.verl <verl overrides> +rollstream.namespace=...
    from rollstream.consumers import _verl_runner

    _verl_runner.main()  # type: ignore[has-type]  # hydra's decorator hides the signature
