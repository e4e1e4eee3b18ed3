"""Policy versions on NS.control: the trainer announces them, producers follow them.

NS.control is compacted and every announcement has the same key (``policy``), so the topic keeps at
least the latest announcement forever and a reader that starts late still learns the current version.

- `PolicyAnnouncer` / `announce_policy_version` (trainer side): write a `PolicyVersion` with acks=all
  and wait for the acknowledgement. Blocking; from an event loop use `PolicyAnnouncer.announce_async`.
- `publish_position` (trainer side): after each commit the trainer's consumer writes its position (a
  `TrainerPosition`, key ``position/<group>``: one record per step, compacted to one per group), which
  producers' backpressure follows instead of each reading the lag from the brokers.
- `ControlWatcher` (producer side): a thread (``rollstream-control``) reads the topic from the beginning
  with an explicit assignment (no group membership, nothing committed) and keeps the highest version;
  `on_version` is called, in that thread, for each newer one (engines that load weights hook it), and
  `on_position` for each trainer position.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from types import TracebackType

from confluent_kafka import OFFSET_BEGINNING, KafkaException, Producer, TopicPartition
from rollstream.infra._worker import WorkerThread
from rollstream.infra.clients import open_consumer, open_producer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError
from rollstream.infra.kafka_io import position_of, produce_and_wait
from rollstream.infra.topics import TopicNames
from rollstream.schemas import DecodeError, PolicyVersion, TrainerPosition, decode, encode

log = logging.getLogger(__name__)
CONTROL_KEY = b"policy"
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


class PolicyAnnouncer:
    """Writes policy versions to NS.control (key ``policy``, idempotent producer, acks=all).

    Construction does no I/O; the producer connects on the first `announce`. A context manager;
    `close` is idempotent. `announce` may be called from any one thread at a time.
    """

    def __init__(self, config: KafkaConfig, names: TopicNames | str) -> None:
        self.topic = names.control if isinstance(names, TopicNames) else TopicNames(names).control
        self._config = config
        self._producer: Producer | None = None

    def __enter__(self) -> PolicyAnnouncer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def announce(self, version: PolicyVersion, *, timeout: float = 30.0) -> None:
        """Publish `version` and block until the broker acknowledged it (at most `timeout` s).

        When it returns, every producer that reads NS.control will see `version` (or a later one).
        Blocks: from an event loop, await `announce_async` instead.

        Raises:
            KafkaIOError (retriable): not acknowledged within `timeout`, or the broker refused it.
        """
        if self._producer is None:
            self._producer = open_producer(self._config.producer({"linger.ms": 0}))
        announce_policy_version(self._producer, self.topic, version, timeout=timeout)

    async def announce_async(self, version: PolicyVersion, *, timeout: float = 30.0) -> None:
        """`announce` in a worker thread, so the event loop never waits on the flush."""
        await asyncio.to_thread(self.announce, version, timeout=timeout)

    def close(self) -> None:
        """Flush what is left (a few seconds at most) and drop the producer. Idempotent."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(5.0)


def announce_policy_version(target: Producer | KafkaConfig, names: TopicNames | str, version: PolicyVersion, *,
                            timeout: float = 30.0) -> None:
    """Write `version` to the control topic and wait for its acknowledgement. Blocks up to `timeout`.

    Args:
        target: a confluent `Producer` to reuse (it is flushed), or a `KafkaConfig` to build a one-off one.
        names: the namespace's `TopicNames`, or the control topic's full name (``NS.control``).

    Raises:
        KafkaIOError (retriable): not acknowledged within `timeout`, or the broker refused it.
    """
    topic = names.control if isinstance(names, TopicNames) else names
    producer = open_producer(target.producer({"linger.ms": 0})) if isinstance(target, KafkaConfig) else target
    try:
        produce_and_wait(producer, topic, [(CONTROL_KEY, encode(version))], timeout=timeout)
    except KafkaIOError as exc:
        raise KafkaIOError(f"policy version {version.version} was not written to {topic}: {exc}", topic=topic,
                           code=exc.code, fatal=exc.fatal, retriable=exc.retriable) from exc
    log.info("announced policy version %d on %s (weights %s)", version.version, topic, version.weights_path)


class ControlWatcher(WorkerThread):
    """Follows NS.control. `start` returns at once; `stop` is idempotent and never blocks.

    Args:
        config: how to reach Kafka.
        topic: the control topic (``NS.control``).
        on_version: called in the watcher thread with each version newer than any seen before; it
            must not block for long (hand work to another thread or loop). Its exceptions are logged.
        on_position: called in the watcher thread with each trainer position (every group's; the
            callee picks its group), under the same rules.
    """

    def __init__(self, config: KafkaConfig, topic: str, *,
                 on_version: Callable[[PolicyVersion], None] | None = None,
                 on_position: Callable[[TrainerPosition], None] | None = None) -> None:
        super().__init__()
        self._conf = config.consumer(f"rollstream-control-watch-{uuid.uuid4().hex[:12]}",
                                     {"fetch.wait.max.ms": 1000})  # a long poll returns when a record comes
        self.topic = topic
        self._on_version = on_version
        self._on_position = on_position
        self._latest: PolicyVersion | None = None
        self._caught_up = threading.Event()

    @property
    def policy_version(self) -> int | None:
        """The highest version announced so far (None before any). Thread-safe."""
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
            pending = {p for p, end in ends.items() if end > 0}
            consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
            while not self._stop.is_set():
                if not pending:
                    self._caught_up.set()
                msg = consumer.poll(0.2)
                if msg is None or msg.error() is not None:
                    continue
                partition, offset = position_of(msg)
                if (msg.key() or b"").startswith(POSITION_KEY_PREFIX):
                    self._handle_position(msg.value() or b"", partition, offset)
                else:
                    self._handle(msg.value() or b"", partition, offset)
                if offset + 1 >= ends.get(partition, 0):
                    pending.discard(partition)
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
        try:
            self._on_position(position)
        except Exception:  # a callback bug must not stop the watcher
            log.exception("on_position callback failed for the position of %s", position.consumer_group)

    def _handle(self, value: bytes, partition: int, offset: int) -> None:
        try:
            version = decode(value, PolicyVersion)
        except DecodeError as exc:
            log.warning("skipping undecodable control record: %s", exc.located(self.topic, partition, offset))
            return
        if self._latest is not None and version.version <= self._latest.version:
            return
        self._latest = version
        log.info("policy version %d announced on %s[%d]@%d (weights %s)", version.version, self.topic, partition,
                 offset, version.weights_path)
        if self._on_version is not None:
            try:
                self._on_version(version)
            except Exception:  # a callback bug must not stop version tracking
                log.exception("on_version callback failed for policy version %d", version.version)
