"""OpenRLHF 0.11.2's async PPO trainer (``openrlhf/trainer/ppo_trainer_async.py``) on rollstream.

OpenRLHF passes rollouts from ``GenerateSamplesActor.fit`` to ``TrainingActor.fit`` through two Ray queues built
in ``PPOTrainerAsync.__init__``: ``rollout_queue`` (size ``--train.async_queue_size``) and ``rollout_slots`` (a
counting semaphore of the same size). A crash loses everything queued, and a resume rewinds the dataloader to
the checkpoint's ``client_states`` and generates again what was queued (OpenRLHF #1322/#1323). The two objects
here stand where those queues stand, with the calls the two actors make on them:

- `RolloutQueue.put` (the generator's ``rollout_queue.put((samples, client_states, filter_pass_rate,
  generation_time))``) publishes the step's Experiences as ScoredGroups, one per prompt
  (`rollstream.consumers._openrlhf_codec`, ``rollstream.openrlhf/1``, no pickles), each stamped with the
  generator's ``client_states``, the trainer step it served and the trainer run; it returns once the broker
  acknowledged all of them (acks=all, idempotent). ``"done"`` is published as an end marker.
- `RolloutQueue.get` (the trainer's ``rollout_queue.get()``) first commits the step it handed over before:
  OpenRLHF calls ``get`` again only after ``train_step`` and ``save_logs_and_checkpoints`` of that step returned,
  so a step is committed only after it trained. Then it takes exactly ``groups_per_step`` groups
  (``--rollout.batch_size`` prompts, one rollstream step) and returns OpenRLHF's tuple: the Experiences in
  order, ``client_states`` (the newest generator position in the step, plus ``rollstream_step``), the pass rate
  and generation time. A crash before the next ``get`` leaves the step uncommitted: the next trainer takes the
  same batch again. After the commit it announces the step's ``global_step`` (which OpenRLHF wrote into the
  ``client_states`` it was handed) as this trainer run's policy version (`rollstream.infra.runs`).
- `RolloutSlots.get` (the generator's ``rollout_slots.get()`` before each batch) blocks while the trainer group's
  lag on NS.rollouts is ``(queue_size + 1) x groups_per_step`` groups or more: at most ``queue_size`` steps
  queued besides the one in training (which stays in the lag until committed), as with OpenRLHF's slots. It
  returns the newest trainer run's announced step (OpenRLHF's slot token, used for eval timing), so producers
  follow a resumed trainer down to its step. `RolloutSlots.put` (a slot given back) has nothing to do.
- Resume (`RolloutQueue.resume`, called with OpenRLHF's ``checkpoint_states`` where ``PPOTrainerAsync.fit``
  reads them): the trainer continues exactly after the rollstream step its checkpoint recorded
  (``client_states["rollstream_step"]``, `RolloutConsumer.seek_to_step`: the committed offsets of that step),
  so every group published after it, also those the dead run had queued or taken, is trained, the same steps
  again first; and the generator's ``episode``, ``total_consumed_prompts`` and ``data_loader_state_dict`` are
  taken from the newest group published (`published_position`), not from the checkpoint: it generates no
  prompt twice. A resumed trainer is a new trainer run: the dead one's commits are refused.

- Eval results (``("eval", global_step, metrics)``) and the generator's ``"done"`` travel as marker records
  (`rollstream.consumers._openrlhf_markers`); `get` hands an eval result over as soon as it read it, in no step.

``python -m rollstream.consumers.openrlhf <train_ppo_ray arguments>`` runs OpenRLHF's own launcher with these
objects in its trainer (`rollstream.consumers._openrlhf_launch`): the one change to a launch script.

Settings (`OpenRLHFSettings`): environment variables ``ROLLSTREAM_BOOTSTRAP_SERVERS``, ``ROLLSTREAM_KAFKA_CONFIG``,
``ROLLSTREAM_NAMESPACE``, ``ROLLSTREAM_TRAINER_GROUP``, or the dataclass's fields. Objects are picklable (Ray
hands them to both actors); each opens its Kafka clients on first use, in the process that uses it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import TopicPartition
from rollstream.consumers._adapters import group_size_filter
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import DEFAULT_GROUP, RolloutConsumer
from rollstream.consumers._openrlhf_codec import decode_group, encode_groups, position_of
from rollstream.consumers._openrlhf_markers import MarkerFilter, end_marker, eval_marker
from rollstream.consumers.filters import GroupFilter, failed_group
from rollstream.infra import KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.infra.clients import open_consumer, open_producer
from rollstream.infra.config import ConfigError
from rollstream.infra.lag import LagReader
from rollstream.infra.runs import followed_policy
from rollstream.schemas import (
    DecodeError,
    PolicyVersion,
    RollstreamError,
    ScoredGroup,
    decode,
    encode,
)

log = logging.getLogger(__name__)
TAIL = 64  # records read back per partition to find the newest generator position (`published_position`)


class PublishFailed(RollstreamError):
    """A step's groups were not all acknowledged within ``kafka_timeout_s``; retriable."""


@dataclass(frozen=True)
class OpenRLHFSettings:
    """rollstream's side of an OpenRLHF run. `groups_per_step`: ``--rollout.batch_size``; `group_size`:
    ``--rollout.n_samples_per_prompt``; `queue_size`: ``--train.async_queue_size``."""

    groups_per_step: int
    group_size: int | None = None
    queue_size: int = 1
    bootstrap_servers: str | None = None
    kafka_config: str | None = None
    namespace: str = "rollstream"
    group: str = DEFAULT_GROUP
    take_timeout_s: float | None = None
    poll_interval_s: float = 0.5
    kafka_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.queue_size < 1:
            raise ConfigError(f"groups_per_step={self.groups_per_step} (--rollout.batch_size) and queue_size="
                              f"{self.queue_size} (--train.async_queue_size) must be >= 1")
        if not self.namespace or not self.group:
            raise ConfigError(f"namespace={self.namespace!r} and group={self.group!r} must be non-empty")
        if self.poll_interval_s <= 0 or self.kafka_timeout_s <= 0:
            raise ConfigError(f"poll_interval_s={self.poll_interval_s} and kafka_timeout_s={self.kafka_timeout_s} "
                              "must be > 0")

    @classmethod
    def of(cls, args: Any) -> OpenRLHFSettings:
        """From OpenRLHF's parsed ``args`` (``args.rollout.batch_size``, ``.n_samples_per_prompt``,
        ``args.train.async_queue_size``) and the ``ROLLSTREAM_*`` environment variables."""
        env = {"bootstrap_servers": "ROLLSTREAM_BOOTSTRAP_SERVERS", "kafka_config": "ROLLSTREAM_KAFKA_CONFIG",
               "namespace": "ROLLSTREAM_NAMESPACE", "group": "ROLLSTREAM_TRAINER_GROUP"}
        given: dict[str, Any] = {name: os.environ[var] for name, var in env.items() if os.environ.get(var)}
        return cls(groups_per_step=args.rollout.batch_size, group_size=args.rollout.n_samples_per_prompt,
                   queue_size=getattr(args.train, "async_queue_size", 1), **given)

    def kafka(self, client_id: str) -> KafkaConfig:
        return KafkaConfig.load(self.bootstrap_servers, Path(self.kafka_config) if self.kafka_config else None,
                                client_id=client_id)


class RolloutQueue:
    """Stands where ``rollout_queue`` stands: `put` on the generator's side, `get` and `resume` on the trainer's.
    Not thread-safe (each actor calls it from one thread). `close` is idempotent."""

    def __init__(self, settings: OpenRLHFSettings) -> None:
        self.settings = settings
        self.names = TopicNames(settings.namespace)
        self.producer_id = f"openrlhf-generator-{uuid.uuid4().hex[:8]}"
        self._producer: Any = None
        self._published = 0
        self._consumer: RolloutConsumer | None = None
        self._announcer: PolicyAnnouncer | None = None
        self._handed: tuple[Batch, dict[str, Any]] | None = None
        self._markers = MarkerFilter()

    def __getstate__(self) -> dict[str, Any]:  # Ray hands a fresh copy to each actor: clients are opened there
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    # -- the generator's side ---------------------------------------------------------------------------

    def put(self, payload: Any, block: bool = True, timeout: float | None = None) -> None:
        """Publish ``(samples, client_states, filter_pass_rate, generation_time)``, ``("eval", global_step,
        metrics)`` or ``"done"`` (`rollstream.consumers._openrlhf_markers`); returns once the broker acknowledged
        every group of it, at most ``kafka_timeout_s``.

        Raises:
            PublishFailed: not all acknowledged in time (retriable: the trainer's dedupe skips a group twice put).
            OpenRLHFEncodingError: an Experience rollstream cannot carry.
        """
        if payload == "done":
            groups = [end_marker(self.producer_id)]
        elif isinstance(payload, tuple) and payload and payload[0] == "eval":
            _, global_step, metrics = payload
            groups = [eval_marker(self.producer_id, global_step, metrics)]
        else:
            samples, client_states, rate, seconds = payload
            followed = self._following()
            groups = encode_groups(samples, position={**client_states, "filter_pass_rate": rate,
                                                      "generation_time": seconds},
                                   producer_id=self.producer_id, first_seq=self._published,
                                   version=followed[0], policy_run=followed[1])
        self._publish(groups)
        self._published += len(groups)

    def _following(self) -> tuple[int, int]:
        s = self.settings
        followed = followed_policy(s.kafka(self.producer_id), self.names.control, timeout=s.kafka_timeout_s).policy
        return (followed.version, followed.run) if followed is not None else (0, 0)

    def _publish(self, groups: Sequence[ScoredGroup]) -> None:
        if self._producer is None:
            conf = self.settings.kafka(self.producer_id).producer()
            self._producer = open_producer({**conf, "message.timeout.ms": int(self.settings.kafka_timeout_s * 1000)})
        failed: list[str] = []

        def delivered(err: Any, msg: Any) -> None:  # librdkafka's delivery report: never blocks
            if err is not None:
                failed.append(f"{(msg.key() or b'').decode()}: {err}")

        for g in groups:
            self._producer.produce(self.names.rollouts, key=g.group_id.encode(), value=encode(g),
                                   on_delivery=delivered)
        left = self._producer.flush(self.settings.kafka_timeout_s)
        if left or failed:
            raise PublishFailed(f"{left} group(s) unanswered and {failed} failed on {self.names.rollouts} within "
                                f"{self.settings.kafka_timeout_s} s: is the broker reachable and the topic created "
                                "(`rollstream topics create`)?", retriable=True)

    # -- the trainer's side -----------------------------------------------------------------------------

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Commit the step handed over last (OpenRLHF trained and checkpointed it before asking again) and
        announce its ``global_step``; then block until exactly ``groups_per_step`` groups are there (at most
        ``take_timeout_s``) and return them as OpenRLHF's ``(samples, client_states, filter_pass_rate,
        generation_time)``; or an eval result the generator put, ``("eval", global_step, metrics)``, as soon as
        it is read (it comes before the steps read after it); or ``"done"`` once the generator ended and no full
        step is left. Nothing of the returned step is committed until the next `get`.

        Raises:
            TakeTimeout: ``take_timeout_s`` passed. RunSupersededError: a newer trainer run began (this one's
                commit is refused). CommitError: the commit failed (retriable: call again).
        """
        consumer = self._trainer()
        if self._handed is not None:
            batch, states = self._handed
            consumer.commit(batch)
            self._handed = None
            if "global_step" in states:
                self.announce(int(states["global_step"]))
        evaluated = self._markers.pop_eval()
        if evaluated is not None:
            return evaluated
        taken = self._take(consumer)
        if taken is None:
            return self._markers.pop_eval() or "done"
        batch = taken
        samples = [e for g in batch.groups for e in decode_group(g)]
        newest = max((position_of(g) or {} for g in batch.groups),
                     key=lambda p: (p.get("episode", 0), p.get("total_consumed_prompts", 0)))
        states = {k: v for k, v in newest.items() if k not in ("filter_pass_rate", "generation_time")}
        states["rollstream_step"] = batch.step
        self._handed = (batch, states)
        return samples, states, newest.get("filter_pass_rate"), newest.get("generation_time", 0.0)

    def announce(self, global_step: int) -> int:
        """Announce `global_step` as this trainer run's policy version (the run begins at its first); returns
        the run. Blocks until written. Raises RunSupersededError once a newer run began."""
        written = self._run().announce(PolicyVersion(global_step, metadata={"trainer": "openrlhf"}),
                                           timeout=self.settings.kafka_timeout_s)
        return written.run

    def resume(self, checkpoint_states: dict[str, Any]) -> dict[str, Any]:
        """OpenRLHF's ``checkpoint_states`` for a resumed run: the trainer seeks to just after the checkpoint's
        ``rollstream_step`` (when it has one) and announces its ``global_step`` (a new trainer run); the result
        has the generator's fields from the newest published group (`published_position`), so the generator
        continues after what is on NS.rollouts. Blocks until committed and read.

        Raises:
            RollstreamError: the group has no such step (what `RolloutConsumer.seek_to_step` raises).
        """
        consumer = self._trainer()
        step = checkpoint_states.get("rollstream_step")
        if step is not None:
            consumer.seek_to_step(int(step))
            log.info("OpenRLHF resumed at global step %s: continuing after rollstream step %d",
                     checkpoint_states.get("global_step"), step)
        self.announce(int(checkpoint_states.get("global_step", 0)))
        published = published_position(self.settings)
        return {**checkpoint_states, **(published or {})}

    def close(self) -> None:
        """Flush what was put, close the clients; a step handed over and not committed comes back. Idempotent."""
        if self._producer is not None:
            self._producer.flush(self.settings.kafka_timeout_s)
            self._producer = None
        if self._consumer is not None:
            self._consumer.close()
        if self._announcer is not None:
            self._announcer.close()

    def _run(self) -> PolicyAnnouncer:
        self._trainer()
        if self._announcer is None:  # never: _trainer creates both
            raise RollstreamError("the trainer run was not created")
        return self._announcer

    def _trainer(self) -> RolloutConsumer:
        if self._consumer is None:
            s = self.settings
            kafka = s.kafka(f"rollstream-openrlhf-trainer-{s.group}")
            self._announcer = PolicyAnnouncer(kafka, self.names)
            sizes = group_size_filter(s.group_size, trainer="OpenRLHF", setting="--rollout.n_samples_per_prompt")
            filters: list[GroupFilter] = [self._markers, failed_group, sizes]
            self._consumer = RolloutConsumer(config=kafka, group_id=s.group, namespace=s.namespace, filters=filters,
                                             timeout=s.kafka_timeout_s, announcer=self._announcer)
        return self._consumer

    def _take(self, consumer: RolloutConsumer) -> Batch | None:
        """One step, or None once an eval result came or the generator ended without a full step left."""
        s, started = self.settings, time.monotonic()
        while True:
            wait = s.poll_interval_s
            if s.take_timeout_s is not None:
                wait = max(0.0, min(wait, started + s.take_timeout_s - time.monotonic()))
            batch = consumer.poll_batch(s.groups_per_step, wait, commit=False)
            if batch is not None:
                return batch
            if self._markers.ended or self._markers.has_eval:
                return None
            if s.take_timeout_s is not None and time.monotonic() - started >= s.take_timeout_s:
                raise consumer.timeout_error(s.groups_per_step, s.take_timeout_s)


class RolloutSlots:
    """Stands where ``rollout_slots`` stands: the generator's `get` waits on the trainer group's lag. Not
    thread-safe. `close` is idempotent."""

    def __init__(self, settings: OpenRLHFSettings) -> None:
        self.settings = settings
        self.names = TopicNames(settings.namespace)
        self._lag: LagReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])  # type: ignore[misc]

    @property
    def limit(self) -> int:
        """The lag (groups) at which the generator waits: ``(queue_size + 1) x groups_per_step``."""
        return (self.settings.queue_size + 1) * self.settings.groups_per_step

    def get(self, block: bool = True, timeout: float | None = None) -> int:
        """Block until the trainer group's lag on NS.rollouts is below `limit`, reading it every
        ``poll_interval_s``; return the newest trainer run's announced step (0: none yet). Commits nothing.

        Raises:
            KafkaIOError: the lag or NS.control could not be read within ``kafka_timeout_s``.
        """
        s = self.settings
        if self._lag is None:
            self._lag = LagReader(s.kafka(f"rollstream-openrlhf-slots-{s.group}"))
        while (lag := self._lag.group_lag(s.group, self.names.rollouts, timeout=s.kafka_timeout_s).total) \
                >= self.limit:
            log.debug("trainer group %s lag %d >= %d: waiting for the trainer", s.group, lag, self.limit)
            time.sleep(s.poll_interval_s)
        followed = followed_policy(s.kafka("rollstream-openrlhf-slots"), self.names.control,
                                   timeout=s.kafka_timeout_s).policy
        return followed.version if followed is not None else 0

    def put(self, global_step: int, block: bool = True, timeout: float | None = None) -> None:
        """A slot given back: nothing to do (the lag moves when the trainer commits)."""

    def close(self) -> None:
        if self._lag is not None:
            self._lag.close()
            self._lag = None


def published_position(settings: OpenRLHFSettings) -> dict[str, Any] | None:
    """The generator's ``client_states`` stamped on the newest OpenRLHF group on NS.rollouts (the highest
    episode, then prompts consumed, among the last `TAIL` records of each partition), or None. Blocks up to
    ``kafka_timeout_s``. Raises KafkaIOError when the topic cannot be read."""
    topic = TopicNames(settings.namespace).rollouts
    consumer = open_consumer(settings.kafka(f"rollstream-openrlhf-tail-{uuid.uuid4().hex[:8]}").consumer(
        f"rollstream-openrlhf-tail-{uuid.uuid4().hex[:8]}"))
    try:
        meta = consumer.list_topics(topic, timeout=settings.kafka_timeout_s).topics[topic]
        bounds = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=settings.kafka_timeout_s)
                  for p in meta.partitions}
        wanted = {p: hi for p, (lo, hi) in bounds.items() if hi > lo}
        consumer.assign([TopicPartition(topic, p, max(bounds[p][0], hi - TAIL)) for p, hi in wanted.items()])
        newest: dict[str, Any] | None = None
        deadline = time.monotonic() + settings.kafka_timeout_s
        while wanted and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error() is not None:
                continue
            if (msg.offset() or 0) + 1 >= wanted.get(msg.partition(), 0):
                wanted.pop(msg.partition(), None)
            try:
                pos = position_of(decode(msg.value() or b"", ScoredGroup))
            except DecodeError:
                continue
            if pos is not None and (newest is None or _order(pos) > _order(newest)):
                newest = pos
        return None if newest is None else {k: newest[k] for k in ("episode", "total_consumed_prompts",
                                                                   "data_loader_state_dict") if k in newest}
    finally:
        consumer.close()


def _order(position: dict[str, Any]) -> tuple[int, int]:
    return int(position.get("episode", 0)), int(position.get("total_consumed_prompts", 0))


if __name__ == "__main__":  # python -m rollstream.consumers.openrlhf <train_ppo_ray arguments> --train.async_enable
    import sys

    from rollstream.consumers._openrlhf_launch import main

    main(sys.argv[1:])
