"""Reading NS.inflight in tests: the newest checkpoint of every key, now or as they come."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from rollstream.infra import KafkaConfig
from rollstream.schemas import InflightCheckpoint, decode

from tests.integration._kafka import end_offsets

Newest = dict[str, InflightCheckpoint | None]  # key -> its newest checkpoint (None: a tombstone)


def newest_checkpoints(config: KafkaConfig, topic: str, *, checkpointed: set[str] | None = None) -> Newest:
    """Every key of `topic` with its newest value, read to the current end (`checkpointed`: gets every key that
    ever had a checkpoint, not only a tombstone)."""
    ends = {p: e for p, e in end_offsets(config, topic).items() if e > 0}
    return watch_checkpoints(config, topic, lambda _: False, timeout_s=20, ends=ends, checkpointed=checkpointed)


def watch_checkpoints(config: KafkaConfig, topic: str, until: Callable[[Newest], bool], *, timeout_s: float,
                      ends: dict[int, int] | None = None, checkpointed: set[str] | None = None) -> Newest:
    """Tail `topic` from its beginning with one consumer, keeping the newest value of each key, until `until`
    holds for them (or, given `ends`, until those offsets are read). AssertionError on timeout."""
    consumer = Consumer(config.consumer(f"reader-{uuid.uuid4().hex[:8]}"))
    partitions = sorted(ends) if ends is not None else range(len(consumer.list_topics(topic).topics[topic].partitions))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    newest: Newest = {}
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.1):
                if not msg.error():
                    value = msg.value()
                    newest[msg.key().decode()] = None if value is None else decode(value, InflightCheckpoint)
                    if value is not None and checkpointed is not None:
                        checkpointed.add(msg.key().decode())
                    if ends is None and until(newest):  # each state, not only a batch's last: a fast producer
                        return newest  # may checkpoint, finish and tombstone a sample within one batch
            if ends is not None:
                left = {tp.partition for tp in consumer.position([TopicPartition(topic, p) for p in ends])
                        if tp.offset < ends[tp.partition]}
                if not left:
                    return newest
    finally:
        consumer.close()
    raise AssertionError(f"{topic}: timed out after {timeout_s} s ({len(newest)} keys read)")
