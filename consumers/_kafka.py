"""Reading helpers over confluent-kafka shared by the consumer, replay and audit.

Every reader here assigns partitions explicitly and never commits: it has a group id only because
librdkafka requires one. All calls block (bounded by their timeouts); none is thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from infra import KafkaConfig, open_consumer
from schemas import RollstreamError, SchemaError, StepManifest, decode

log = logging.getLogger(__name__)
_BATCH = 500


def wrap_kafka_error(what: str, exc: KafkaException) -> RollstreamError:
    err = exc.args[0] if exc.args else None
    if isinstance(err, KafkaError):
        return RollstreamError(f"{what}: {err.str()}", retriable=err.retriable() or err.code() == KafkaError._TIMED_OUT)
    return RollstreamError(f"{what}: {exc}", retriable=True)


@contextmanager
def reader(config: KafkaConfig, group_id: str) -> Iterator[Consumer]:
    """A consumer that only reads (explicit assignment, no commits); closed on exit."""
    consumer = open_consumer(config.consumer(group_id, {"enable.partition.eof": False}))
    try:
        yield consumer
    finally:
        consumer.close()


def partitions_of(consumer: Consumer, topic: str, timeout: float) -> list[int]:
    """Partition ids of `topic`. Raises RollstreamError if it does not exist or the broker is unreachable."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
    except KafkaException as exc:
        raise wrap_kafka_error(f"cannot read metadata of {topic}", exc) from exc
    info = meta.topics.get(topic)
    if info is None or info.error is not None or not info.partitions:
        raise RollstreamError(f"topic {topic} does not exist: run 'rollstream topics create' first")
    return sorted(info.partitions)


def committed_offsets(consumer: Consumer, topic: str, partitions: list[int], timeout: float) -> dict[int, int | None]:
    """The consumer's group committed offsets on `topic` (None where it has committed nothing)."""
    try:
        tps = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout)
    except KafkaException as exc:
        raise wrap_kafka_error(f"cannot read committed offsets on {topic}", exc) from exc
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in tps}


def watermarks(consumer: Consumer, topic: str, partition: int, timeout: float) -> tuple[int, int]:
    """(low, high) offsets of a partition: the first stored record and one past the last."""
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout, cached=False)
    except KafkaException as exc:
        raise wrap_kafka_error(f"cannot read offsets of {topic}[{partition}]", exc) from exc
    return low, high


def check(msg: Message) -> bool:
    """True for a record; False for a benign event (partition EOF). Raises on a fatal error."""
    err = msg.error()
    if err is None:
        return True
    if err.code() == KafkaError._PARTITION_EOF:
        return False
    if err.fatal() or not err.retriable():
        raise RollstreamError(f"reading {msg.topic()}[{msg.partition()}] failed: {err.str()}",
                              retriable=err.retriable())
    log.warning("transient error reading %s[%s]: %s", msg.topic(), msg.partition(), err.str())
    return False


def read_ranges(config: KafkaConfig, topic: str, bounds: Mapping[int, tuple[int, int]], *,
                group_id: str = "rollstream-reader", timeout: float = 30.0,
                progress: Callable[[int], None] | None = None) -> Iterator[Message]:
    """Yield the records of `topic` in the offset ranges [start, end) per partition, in order per partition.

    Ends are clamped to what the partition holds now; starts below the first stored offset (deleted by
    retention) are raised to it with a warning. `progress` gets the number of offsets advanced.
    Blocks until done; raises RollstreamError (retriable) after `timeout` s without progress.
    """
    with reader(config, group_id) as consumer:
        todo: dict[int, tuple[int, int]] = {}
        for p, (start, end) in bounds.items():
            low, high = watermarks(consumer, topic, p, timeout)
            if start < low:
                log.warning("%s[%d]: offsets [%d, %d) were deleted (retention); starting at %d",
                            topic, p, start, low, low)
            start, end = max(start, low), min(end, high)
            if start < end:
                todo[p] = (start, end)
        if not todo:
            return
        consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in todo.items()])
        yield from _drain(consumer, topic, todo, timeout, progress)


def _drain(consumer: Consumer, topic: str, todo: dict[int, tuple[int, int]], timeout: float,
           progress: Callable[[int], None] | None) -> Iterator[Message]:
    nexts = {p: start for p, (start, _) in todo.items()}
    last_progress = time.monotonic()
    while todo:
        # consume() waits for all it asks for: ask for no more than is left, or every call would wait out the timeout.
        left = sum(end - nexts[p] for p, (_, end) in todo.items())
        msgs = consumer.consume(max(1, min(_BATCH, left)), timeout=min(1.0, timeout))
        if not msgs and time.monotonic() - last_progress > timeout:
            raise RollstreamError(f"no progress reading {topic} for {timeout:g} s (still to read: "
                                  + ", ".join(f"[{p}] {nexts[p]}..{e}" for p, (_, e) in todo.items()) + ")",
                                  retriable=True)
        for msg in msgs:
            if not check(msg) or msg.partition() not in todo:
                continue
            p, offset = msg.partition(), msg.offset()
            end = todo[p][1]
            if offset >= end:
                _done(consumer, topic, todo, p)
                continue
            if progress is not None:
                progress(offset + 1 - nexts[p])
            nexts[p] = offset + 1
            last_progress = time.monotonic()
            yield msg
            if offset + 1 >= end:
                _done(consumer, topic, todo, p)


def _done(consumer: Consumer, topic: str, todo: dict[int, tuple[int, int]], partition: int) -> None:
    todo.pop(partition, None)
    consumer.pause([TopicPartition(topic, partition)])


def read_manifests(config: KafkaConfig, steps_topic: str, consumer_group: str, *, timeout: float = 30.0,
                   on_bad: Callable[[int, SchemaError], None] | None = None) -> list[StepManifest]:
    """Every StepManifest of `consumer_group` on `steps_topic` (keyed by group), in log order.

    Records of other groups are skipped without decoding; an undecodable record under this group's
    key is reported to `on_bad(offset, error)` (default: a warning) and skipped.
    """
    key = consumer_group.encode()
    out: list[StepManifest] = []
    with reader(config, f"{consumer_group}.manifest-reader") as consumer:
        partitions = partitions_of(consumer, steps_topic, timeout)
        bounds = {p: watermarks(consumer, steps_topic, p, timeout) for p in partitions}
    for msg in read_ranges(config, steps_topic, bounds, group_id=f"{consumer_group}.manifest-reader",
                           timeout=timeout):
        if msg.key() != key:
            continue
        try:
            manifest = decode(msg.value() or b"", StepManifest)
        except SchemaError as exc:
            exc.located(steps_topic, msg.partition(), msg.offset())
            if on_bad is None:
                log.warning("skipping an undecodable step manifest: %s", exc)
            else:
                on_bad(msg.offset(), exc)
            continue
        if manifest.consumer_group == consumer_group:
            out.append(manifest)
    return out



def produce_and_wait(producer: Producer, topic: str, key: str, values: list[bytes], timeout: float) -> str | None:
    """Produce `values` under `key` and wait until the broker acknowledged all; return an error text or None."""
    errors: list[str] = []

    def delivered(err: object, _msg: object) -> None:  # runs inside flush(), on this thread
        if err is not None:
            errors.append(str(err))

    try:
        for value in values:
            producer.produce(topic, value, key=key, on_delivery=delivered)
        left = producer.flush(timeout)
    except (KafkaException, BufferError) as exc:
        return str(exc)
    if errors:
        return ", ".join(errors)
    return f"not acknowledged within {timeout:g} s" if left else None


def commit_offsets(consumer: Consumer, topic: str, offsets: Mapping[int, int]) -> str | None:
    """Commit `offsets` (partition -> next offset to read) synchronously; return an error text or None."""
    tps = [TopicPartition(topic, p, o) for p, o in sorted(offsets.items())]
    try:
        result = consumer.commit(offsets=tps, asynchronous=False)
    except KafkaException as exc:
        return str(exc.args[0] if exc.args else exc)
    failed = [tp for tp in result or [] if tp.error is not None]
    return ", ".join(f"partition {tp.partition}: {tp.error}" for tp in failed) or None
