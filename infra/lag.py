"""Consumer-group lag on a topic, read through the admin API (no consumer joins the group).

Lag of a partition = its end offset minus the group's committed offset (or minus the partition's
start offset when the group has committed nothing there yet, since the group would start there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from infra.clients import open_admin
from infra.config import KafkaConfig
from schemas import RollstreamError

# A request answers within its request_timeout; waiting a little longer on its future lets the broker's
# own timeout error (which says more) arrive first.
_GRACE_S = 1.0
# Retrying a read that failed for a passing reason (coordinator loading, reconnecting).
_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 1.0
_MIN_ATTEMPT_S = 0.5


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

    Not thread-safe per instance (one admin client); cheap to create one per thread. Close it, or use
    it as a context manager.
    """

    def __init__(self, config: KafkaConfig) -> None:
        self._admin = open_admin(config.admin())

    def __enter__(self) -> LagReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Idempotent. The admin client holds no group membership, so there is nothing to leave."""

    def partitions(self, topic: str, *, timeout: float = 10.0) -> list[int]:
        """Partition ids of `topic`. Raises RollstreamError if the topic does not exist."""
        meta = self._admin.list_topics(topic, timeout=timeout)
        info = meta.topics.get(topic)
        if info is None or info.error is not None:
            raise RollstreamError(f"topic {topic} does not exist: run 'rollstream topics create' first")
        return sorted(info.partitions)

    def group_lag(self, group: str, topic: str, *, timeout: float = 10.0) -> GroupLag:
        """The lag of `group` on every partition of `topic`. Blocks up to about `timeout` s.

        A retriable broker error (coordinator still loading after a broker start, a connection being
        re-established) is retried until `timeout` runs out.

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

    def _group_lag(self, group: str, topic: str, timeout: float) -> GroupLag:
        try:
            parts = self.partitions(topic, timeout=timeout)
            tps = [TopicPartition(topic, p) for p in parts]
            request = [ConsumerGroupTopicPartitions(group, tps)]
            committed_future = self._admin.list_consumer_group_offsets(request, request_timeout=timeout)[group]
            answer = committed_future.result(timeout=timeout + _GRACE_S)
            committed = {tp.partition: tp.offset for tp in answer.topic_partitions}
            ends = self._offsets(tps, OffsetSpec.latest(), timeout)
            starts = self._offsets(tps, OffsetSpec.earliest(), timeout)
        except KafkaException as exc:
            raise RollstreamError(f"cannot read lag of group {group} on {topic}: {exc.args[0]}",
                                  retriable=True) from exc
        except TimeoutError as exc:  # a future's result() that outlived its wait (broker slow or down)
            raise RollstreamError(f"cannot read lag of group {group} on {topic}: no answer from the broker "
                                  f"within {timeout:.1f} s", retriable=True) from exc
        rows = tuple(
            PartitionLag(p, committed[p] if committed.get(p, -1) >= 0 else None, starts[p], ends[p])
            for p in parts
        )
        return GroupLag(group, topic, rows)

    def _offsets(self, tps: list[TopicPartition], spec: OffsetSpec, timeout: float) -> dict[int, int]:
        futures = self._admin.list_offsets({tp: spec for tp in tps}, request_timeout=timeout)
        return {tp.partition: f.result(timeout=timeout + _GRACE_S).offset for tp, f in futures.items()}
