"""Consumer-group lag on a topic, read by a consumer of that group that never joins it.

Lag of a partition = its end offset minus the group's committed offset (or minus the partition's
start offset when the group has committed nothing there yet, since the group would start there).

The reader asks as the group's own consumers do (committed offsets through the group coordinator,
watermarks from the partition leaders), never through the admin API: librdkafka 2.16's admin client
was seen to leave a ListConsumerGroupOffsets unsent for good after a broker restart, and to abort the
process (``rd_kafka_enq_once_del_source_return`` assertion) when a cluster node died under it. It never
subscribes, so it never joins the group, triggers no rebalance and commits nothing. Every request runs on
the caller's thread with librdkafka's own timeout, so a reader is never closed under a request still running.
A read has one deadline: its retries and every request in them spend it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaException
from rollstream.infra.clients import open_consumer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import KafkaIOError
from rollstream.infra.kafka_io import committed_offsets, partitions_of, watermarks
from rollstream.schemas import RollstreamError

# Retrying a read that failed for a passing reason (coordinator loading, reconnecting).
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 1.0
# The group id of the consumer that only reads metadata (`partitions`); it never commits or joins.
_METADATA_GROUP = "rollstream-lag-reader"


@dataclass(frozen=True)
class PartitionLag:
    partition: int
    committed: int | None
    start: int
    end: int

    @property
    def lag(self) -> int:
        return self.end - (self.start if self.committed is None else max(self.committed, self.start))


@dataclass(frozen=True)
class GroupLag:
    group: str
    topic: str
    partitions: tuple[PartitionLag, ...]

    @property
    def total(self) -> int:
        return sum(p.lag for p in self.partitions)


class LagReader:
    """Reads a consumer group's lag on a topic. Blocking: call it off any event loop.

    Not thread-safe per instance (one consumer per group asked about); cheap to create one per thread.
    Close it, or use it as a context manager.
    """

    def __init__(self, config: KafkaConfig) -> None:
        self._config = config
        self._consumers: dict[str, Consumer] = {}

    def __enter__(self) -> LagReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the consumers (they hold no membership: nothing to leave). Idempotent."""
        consumers, self._consumers = list(self._consumers.values()), {}
        for consumer in consumers:
            try:
                consumer.close()
            except (KafkaException, RuntimeError):
                pass

    def partitions(self, topic: str, *, timeout: float | Deadline = 10.0) -> list[int]:
        """Partition ids of `topic`. Blocks up to `timeout` (seconds or a `Deadline`).

        Raises:
            KafkaIOError: the topic does not exist (`rollstream.infra.kafka_errors.missing_topic_error`), or
                (retriable) no answer.
        """
        return self._partitions(self._consumer(_METADATA_GROUP), topic, timeout)

    def group_lag(self, group: str, topic: str, *, timeout: float | Deadline = 10.0) -> GroupLag:
        """The lag of `group` on every partition of `topic`. Returns or raises within `timeout` (seconds or a
        `Deadline`) plus `rollstream.infra.deadline.GRACE_S`, whatever the broker does.

        A retriable broker error (coordinator still loading after a broker start, a leader moving, a
        connection being re-established) is retried while `timeout` lasts; every attempt spends the one deadline.

        Raises:
            KafkaIOError: the topic does not exist; or (retriable) no good answer within `timeout` (is the broker
                up? the message says what did not answer).
        """
        deadline = Deadline.of(timeout)
        backoff = _FIRST_BACKOFF_S
        while True:
            try:
                return self._group_lag(group, topic, deadline)
            except RollstreamError as exc:
                if not exc.retriable or deadline.remaining() <= backoff:
                    raise
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)

    def _consumer(self, group: str) -> Consumer:
        consumer = self._consumers.get(group)
        if consumer is None:
            consumer = open_consumer(self._config.consumer(group, {"enable.partition.eof": False}))
            self._consumers[group] = consumer
        return consumer

    def _partitions(self, consumer: Consumer, topic: str, timeout: float | Deadline) -> list[int]:
        return partitions_of(consumer, topic, timeout=timeout)

    def _group_lag(self, group: str, topic: str, deadline: Deadline) -> GroupLag:
        consumer = self._consumer(group)
        parts = self._partitions(consumer, topic, deadline)
        try:
            committed = committed_offsets(consumer, topic, parts, timeout=deadline)
            bounds = {p: watermarks(consumer, topic, p, timeout=deadline) for p in parts}
        except KafkaIOError as exc:
            # Any failure here is a passing one (coordinator loading, leader moving): retried by group_lag.
            raise KafkaIOError(f"cannot read lag of group {group} on {topic}: {exc}", topic=topic,
                               partition=exc.partition, code=exc.code, fatal=exc.fatal, retriable=True) from exc
        if any(b[0] < 0 or b[1] < 0 for b in bounds.values()):
            raise KafkaIOError(f"cannot read lag of group {group} on {topic}: a partition leader gave no offsets "
                               f"({bounds}); retrying may help", topic=topic, retriable=True)
        rows = tuple(PartitionLag(p, committed.get(p), bounds[p][0], bounds[p][1]) for p in parts)
        return GroupLag(group, topic, rows)
