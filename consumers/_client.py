"""The trainer's librdkafka consumer on NS.rollouts: explicitly assigned, and replaceable.

A client can lose its group coordinator for good after a broker stall (confluentinc/librdkafka#5511):
fetches keep working, every committed-offsets lookup and commit times out. `RolloutConsumer` then
installs a fresh client (`swap`) at the position it holds, and a fresh commit client (`StepCommitter.renew`),
by the one replacement policy (`rollstream.infra._replaceable.ClientReplacement`), which closes the old one in the
background, since a client without a coordinator may take long to close. This client only fetches: the
group's commits go through a client of their own (`rollstream.infra.commits.CommitClient`), since waiting for
an asynchronous commit's answer polls the client that made it. Not thread-safe, like its owner.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping

from confluent_kafka import Consumer, KafkaException, TopicPartition
from rollstream.consumers._gather import Entry
from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra._replaceable import close_quietly
from rollstream.infra.clients import open_consumer
from rollstream.infra.kafka_errors import kafka_error, not_authorized_error
from rollstream.infra.kafka_io import is_record, position_of
from rollstream.schemas import LifecycleError

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0


class TrainerClient:
    """Holds the consumer of `group_id` on `topic` (none until `open`)."""

    def __init__(self, group_id: str, topic: str, overrides: Mapping[str, object]) -> None:
        self.group_id, self.topic = group_id, topic
        self._overrides = {"enable.partition.eof": False, **overrides}
        self._consumer: Consumer | None = None

    @property
    def opened(self) -> bool:
        return self._consumer is not None

    def open(self, config: KafkaConfig) -> Consumer:
        """A new client (not yet assigned); it becomes this holder's client once `assign` is called."""
        return open_consumer(config.consumer(self.group_id, self._overrides))

    def use(self, consumer: Consumer, position: Mapping[int, int]) -> None:
        """Assign `consumer` at `position` (partition -> next offset to fetch) and make it the client."""
        consumer.assign([TopicPartition(self.topic, p, o) for p, o in position.items()])
        self._consumer = consumer

    def current(self) -> Consumer:
        if self._consumer is None:
            raise LifecycleError(f"the client of group {self.group_id} is not open: call use() first")
        return self._consumer

    def swap(self, fresh: Consumer, position: Mapping[int, int]) -> Consumer | None:
        """Make `fresh`, assigned at `position`, the client; return the one it replaces (the caller closes it)."""
        stale = self._consumer
        self.use(fresh, position)
        return stale

    def fetch_into(self, buffer: deque[Entry], count: int, wait: float) -> None:
        """Append up to `count` records to `buffer`, waiting up to `wait` s.

        Raises:
            KafkaIOError: the fetch failed, or an error event came (the records around it are kept).
        """
        try:
            msgs = self.current().consume(count, timeout=wait)
        except KafkaException as exc:
            raise kafka_error(f"cannot fetch from {self.topic}", exc, topic=self.topic) from exc
        error: KafkaIOError | None = None
        for msg in msgs:
            try:
                if is_record(msg):
                    buffer.append(Entry(*position_of(msg), msg.key(), msg.value() or b""))
            except KafkaIOError as exc:  # an error event, not a record: keep the records after it
                error = error or exc
        if error is not None and error.code == "GROUP_AUTHORIZATION_FAILED":  # name the group that was refused
            raise not_authorized_error(error.code, self.group_id, self.topic.rsplit(".", 1)[0]) from error
        if error is not None:
            raise error

    def records_after(self, position: Mapping[int, int]) -> int:
        """Records after `position`, from the end offsets the client saw on its last fetch (no network
        call); 0 before it is open."""
        ends = self.end_offsets(list(position))
        return sum(max(0, ends[p] - pos) for p, pos in position.items() if p in ends)

    def end_offsets(self, partitions: list[int]) -> dict[int, int]:
        """The end offset of each of `partitions` as the client last saw it in a fetch response (no network
        call); partitions not seen yet are left out."""
        consumer, out = self._consumer, dict[int, int]()
        if consumer is None:
            return out
        for p in partitions:
            try:
                bounds = consumer.get_watermark_offsets(TopicPartition(self.topic, p), cached=True)
            except KafkaException:
                continue
            if bounds is not None and bounds[1] >= 0:
                out[p] = bounds[1]
        return out

    def close(self, wait_s: float = CLOSE_TIMEOUT_S) -> None:
        """Close the client, waiting at most `wait_s`. It only fetches (the group's commits go through a client of
        their own, `rollstream.infra.commits.CommitClient`) and no call on it outlives its caller, so nothing
        else of this process is inside it; a close that does not finish in time is left to the process."""
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        if not close_quietly(consumer.close, f"trainer-{self.group_id}", wait_s=wait_s):
            log.warning("the Kafka client of group %s did not close within %g s; left to the process",
                        self.group_id, wait_s)

