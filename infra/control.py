"""Policy versions on NS.control: the trainer announces them, producers follow them.

NS.control is compacted and every announcement has the same key (``policy``), so the topic keeps at
least the latest announcement forever and a reader that starts late still learns the current version.

- `PolicyAnnouncer` / `announce_policy_version` (trainer side, `rollstream.infra.runs`): each announcer is
  one trainer run; the newest run's announcements are the ones producers follow.
- `publish_position` (trainer side): after each commit the trainer's consumer writes its position (a
  `TrainerPosition`, key ``position/<group>``: one record per step, compacted to one per group), which
  producers' backpressure follows instead of each reading the lag from the brokers.
- `ControlWatcher` (producer side): a thread (``rollstream-control``) reads the topic from the beginning
  with an explicit assignment (no group membership, nothing committed) and keeps the announcement to
  follow by the runs' rule (`rollstream.infra.runs.follow_verdict`: the newest run's latest word, also a
  lower version than an older run's); `on_version` is called, in that thread, for each one to follow
  (engines that load weights hook it), `on_superseded` for each from a superseded run, and `on_position`
  for each trainer position.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Producer, TopicPartition
from rollstream.infra.clients import open_consumer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_io import position_of
from rollstream.infra.runs import Verdict, caught_up, follow_verdict
from rollstream.infra.threads import WorkerThread
from rollstream.schemas import DecodeError, PolicyVersion, TrainerPosition, decode, encode

log = logging.getLogger(__name__)
_T = TypeVar("_T")
POSITION_KEY_PREFIX = b"position/"


def position_key(consumer_group: str) -> bytes:
    """The NS.control key of `consumer_group`'s trainer positions."""
    return POSITION_KEY_PREFIX + consumer_group.encode()


def publish_position(producer: Producer, topic: str, position: TrainerPosition) -> None:
    """Queue `position` for NS.control (`topic`) on `producer` without waiting: a hint that the next one
    replaces, so a lost one costs producers only a few milliseconds of reaction. Never blocks; a delivery
    failure is logged (at debug level: the producers' slow lag reads are the fallback)."""
    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            log.debug("trainer position of %s, step %d, not delivered to %s: %s", position.consumer_group,
                      position.step, topic, err)

    try:
        producer.produce(topic, encode(position), key=position_key(position.consumer_group), on_delivery=delivered)
        producer.poll(0)
    except (BufferError, KafkaException) as exc:
        log.debug("trainer position of %s not queued for %s: %s", position.consumer_group, topic, exc)


class ControlWatcher(WorkerThread):
    """Follows NS.control. `start` returns at once; `stop` is idempotent and never blocks.

    Args:
        config: how to reach Kafka.
        topic: the control topic (``NS.control``).
        on_version: called in the watcher thread with each announcement to follow (the runs' rule:
            `rollstream.infra.runs.follow_verdict`), in order; it must not block for long (hand work to
            another thread or loop). Its exceptions are logged.
        on_superseded: called in the watcher thread with each announcement of a superseded run (it moves
            nobody), under the same rules.
        on_position: called in the watcher thread with each trainer position (every group's; the
            callee picks its group), under the same rules.
    """

    def __init__(self, config: KafkaConfig, topic: str, *,
                 on_version: Callable[[PolicyVersion], None] | None = None,
                 on_superseded: Callable[[PolicyVersion], None] | None = None,
                 on_position: Callable[[TrainerPosition], None] | None = None) -> None:
        super().__init__()
        self._conf = config.consumer(f"rollstream-control-watch-{uuid.uuid4().hex[:12]}",
                                     {"fetch.wait.max.ms": 1000})  # a long poll returns when a record comes
        self.topic = topic
        self._on_version = on_version
        self._on_superseded = on_superseded
        self._on_position = on_position
        self._latest: PolicyVersion | None = None
        self._caught_up = threading.Event()

    @property
    def followed(self) -> PolicyVersion | None:
        """The announcement producers follow now: the newest run's latest (None before any). Thread-safe."""
        return self._latest

    @property
    def policy_version(self) -> int | None:
        """The version producers follow now (None before any announcement). Thread-safe."""
        latest = self._latest
        return None if latest is None else latest.version

    def start(self) -> None:
        """Start following the topic in thread ``rollstream-control``; returns at once. Idempotent."""
        self._launch(self._run, "rollstream-control")

    def wait_caught_up(self, timeout: float) -> bool:
        """Block up to `timeout` until every record present at startup was read; False on timeout."""
        return self._caught_up.wait(timeout)

    def _run(self) -> None:
        consumer = open_consumer(self._conf)
        try:
            meta = consumer.list_topics(self.topic, timeout=10.0).topics.get(self.topic)
            if meta is None or meta.error is not None:
                log.warning("control topic %s not readable; samples get no policy version from it", self.topic)
                return
            ends = {p: consumer.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10.0)[1]
                    for p in meta.partitions}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
            while not self._stop.is_set():
                if not self._caught_up.is_set() and caught_up(consumer, self.topic, ends):
                    self._caught_up.set()
                msg = consumer.poll(0.2)
                if msg is None or msg.error() is not None:
                    continue
                partition, offset = position_of(msg)
                if (msg.key() or b"").startswith(POSITION_KEY_PREFIX):
                    self._handle_position(msg.value() or b"", partition, offset)
                else:
                    self._handle(msg.value() or b"", partition, offset)
        except KafkaException as exc:
            log.warning("control watcher stopped: %s", exc)
        finally:
            self._caught_up.set()  # nothing more will come: do not keep anyone waiting
            consumer.close()

    def _handle_position(self, value: bytes, partition: int, offset: int) -> None:
        if self._on_position is None:
            return
        try:
            position = decode(value, TrainerPosition)
        except DecodeError as exc:
            log.warning("skipping an undecodable trainer position: %s", exc.located(self.topic, partition, offset))
            return
        self._call(self._on_position, position, f"the position of {position.consumer_group}")

    def _handle(self, value: bytes, partition: int, offset: int) -> None:
        try:
            version = decode(value, PolicyVersion)
        except DecodeError as exc:
            log.warning("skipping undecodable control record: %s", exc.located(self.topic, partition, offset))
            return
        verdict = follow_verdict(self._latest, version)
        if verdict is Verdict.SAME:
            return
        if verdict is Verdict.SUPERSEDED:
            latest = self._latest
            log.warning("ignoring policy %s (run id %s) announced on %s[%d]@%d: that trainer run was superseded; "
                        "producers follow %s", version.label(), version.run_id, self.topic, partition, offset,
                        latest.label() if latest else "a newer run")
            if self._on_superseded is not None:
                self._call(self._on_superseded, version, f"superseded {version.label()}")
            return
        if self._latest is not None and version.run != self._latest.run:
            log.warning("trainer run %d began on %s: producers now follow its %s (run %d was at version %d)",
                        version.run, self.topic, version.label(), self._latest.run, self._latest.version)
        self._latest = version
        log.info("policy %s announced on %s[%d]@%d (weights %s)", version.label(), self.topic, partition,
                 offset, version.weights_path)
        if self._on_version is not None:
            self._call(self._on_version, version, f"policy {version.label()}")

    @staticmethod
    def _call(callback: Callable[[_T], None], value: _T, what: str) -> None:
        try:
            callback(value)
        except Exception:  # a callback bug must not stop the watcher
            log.exception("a control watcher callback failed for %s", what)
