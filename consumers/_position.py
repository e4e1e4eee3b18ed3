"""The trainer's position on NS.control after each commit, for the producers' backpressure.

Each producer's lag gate would otherwise ask the brokers for the trainer group's committed offsets and
every partition's end offset twice a second: O(producers x partitions) requests per second for one
number the trainer knows. After every commit the consumer publishes it instead: one small
`TrainerPosition` record per step (key ``position/<group>``, so NS.control compacts to the latest per
group), committed offsets and the end offsets its client last saw. Those ends come from the client's
fetch responses, at no extra request: the fetcher long-polls every assigned partition and a response
comes as soon as a record arrives, so they are as fresh as the fetch round trip (the fetcher stops only
when librdkafka's queue is full, and then the lag is far past any gate anyway).

It is a hint: a position that is lost or late costs producers a few seconds at most (they still read
the lag themselves, slowly). So publishing never waits and never fails a commit, and it uses a producer
of its own, so an unknown or unwritable NS.control can never hold up the manifests.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from confluent_kafka import KafkaException, Producer
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.clients import open_producer
from rollstream.infra.control import publish_position
from rollstream.schemas import TrainerPosition, now_ms

log = logging.getLogger(__name__)
_FLUSH_S = 1.0


class PositionPublisher:
    """Publishes `group_id`'s position on `names.control`. Not thread-safe; no I/O until `start`."""

    def __init__(self, names: TopicNames, group_id: str) -> None:
        self.names, self.group_id = names, group_id
        self._producer: Producer | None = None

    def start(self, config: KafkaConfig, *, timeout: float) -> None:
        """Open the producer if NS.control exists (a namespace without it gets no positions: producers
        then read the lag themselves). Blocks up to `timeout` for the topic's metadata; never raises."""
        if self._producer is not None:
            return
        producer = open_producer(config.producer({"linger.ms": 0, "message.timeout.ms": 10_000}))
        error: object = None
        try:
            meta = producer.list_topics(self.names.control, timeout=timeout).topics.get(self.names.control)
        except KafkaException as exc:
            meta, error = None, exc
        else:
            error = None if meta is None else meta.error
        if meta is None or error is not None:
            log.info("no trainer positions for group %s: %s is not readable (%s); producers read the lag "
                     "themselves", self.group_id, self.names.control, error or "missing")
            producer.flush(0)
            return
        self._producer = producer

    def publish(self, step: int, committed: Mapping[int, int | None], ends: Mapping[int, int]) -> None:
        """Queue the position after `step`: per partition the committed offset (None: nothing yet, counted
        from 0) and the end offset seen. Never blocks."""
        if self._producer is None:
            return
        offsets = {p: c or 0 for p, c in committed.items()}
        position = TrainerPosition(consumer_group=self.group_id, topic=self.names.rollouts, step=step,
                                   committed=offsets, ends={p: max(ends.get(p, 0), c) for p, c in offsets.items()},
                                   observed_at_ms=now_ms())
        publish_position(self._producer, self.names.control, position)

    def close(self, timeout: float = _FLUSH_S) -> None:
        """Deliver what is queued (at most a second, and at most `timeout`). Idempotent."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(min(timeout, _FLUSH_S))
