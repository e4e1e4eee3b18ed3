"""Consumer-group lag on a topic, read by a consumer of that group that never joins it.

Lag of a partition = its end offset minus the group's committed offset (or minus the partition's
start offset when the group has committed nothing there yet, since the group would start there).

The reader asks as the group's own consumers do (committed offsets through the group coordinator,
watermarks from the partition leaders), never through the admin API: librdkafka 2.16's admin client
was seen to leave a ListConsumerGroupOffsets unsent for good after a broker restart, and to abort the
process (``rd_kafka_enq_once_del_source_return`` assertion) when a cluster node died under it. It never
subscribes, so it never joins the group, triggers no rebalance and commits nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from infra.clients import open_consumer
from infra.config import KafkaConfig
from schemas import RollstreamError

# Retrying a read that failed for a passing reason (coordinator loading, reconnecting).
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 1.0
_MIN_ATTEMPT_S = 0.5
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

    def partitions(self, topic: str, *, timeout: float = 10.0) -> list[int]:
        """Partition ids of `topic`. Raises RollstreamError if the topic does not exist."""
        return self._partitions(self._consumer(_METADATA_GROUP), topic, timeout)

    def group_lag(self, group: str, topic: str, *, timeout: float = 10.0) -> GroupLag:
        """The lag of `group` on every partition of `topic`. Blocks up to about `timeout` s.

        A retriable broker error (coordinator still loading after a broker start, a leader moving, a
        connection being re-established) is retried until `timeout` runs out.

        Raises:
            RollstreamError: the topic does not exist; or (retriable) no good answer within `timeout`.
        """
        deadline = time.monotonic() + timeout
        backoff = _FIRST_BACKOFF_S
        while True:
            try:
                return self._group_lag(group, topic, max(_MIN_ATTEMPT_S, deadline - time.monotonic()))
            except RollstreamError as exc:
                if not exc.retriable or time.monotonic() + backoff >= deadline:
                    raise
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)

    def _consumer(self, group: str) -> Consumer:
        consumer = self._consumers.get(group)
        if consumer is None:
            consumer = open_consumer(self._config.consumer(group, {"enable.partition.eof": False}))
            self._consumers[group] = consumer
        return consumer

    def _partitions(self, consumer: Consumer, topic: str, timeout: float) -> list[int]:
        try:
            meta = consumer.list_topics(topic, timeout=timeout)
        except KafkaException as exc:
            raise RollstreamError(f"cannot read the partitions of {topic}: {exc.args[0]}", retriable=True) from exc
        info = meta.topics.get(topic)
        if info is None or (info.error is not None and info.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            raise RollstreamError(f"topic {topic} does not exist: run 'rollstream topics create' first")
        if info.error is not None:
            raise RollstreamError(f"cannot read the partitions of {topic}: {info.error.str()}",
                                  retriable=info.error.retriable())
        return sorted(info.partitions)

    def _group_lag(self, group: str, topic: str, timeout: float) -> GroupLag:
        consumer = self._consumer(group)
        deadline = time.monotonic() + timeout
        parts = self._partitions(consumer, topic, timeout)
        where = f"cannot read lag of group {group} on {topic}"
        try:
            answer = consumer.committed([TopicPartition(topic, p) for p in parts],
                                        timeout=max(0.1, deadline - time.monotonic()))
            committed = {tp.partition: tp.offset for tp in answer if tp.error is None}
            failed = [tp for tp in answer if tp.error is not None]
            if failed:
                raise RollstreamError(f"{where}: partition {failed[0].partition}: {failed[0].error}", retriable=True)
            bounds = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), cached=False,
                                                        timeout=max(0.1, deadline - time.monotonic()))
                      for p in parts}
        except KafkaException as exc:
            raise RollstreamError(f"{where}: {exc.args[0]}", retriable=True) from exc
        if any(b is None or b[0] < 0 or b[1] < 0 for b in bounds.values()):
            raise RollstreamError(f"{where}: a partition leader gave no offsets ({bounds})", retriable=True)
        rows = tuple(
            PartitionLag(p, committed[p] if committed.get(p, -1) >= 0 else None, bounds[p][0], bounds[p][1])
            for p in parts
        )
        return GroupLag(group, topic, rows)
