"""The Kafka reads and writes both sides need. Every failure is a `KafkaIOError` from the one mapping of
librdkafka errors (`rollstream.infra.kafka_errors.kafka_error`): what failed, where, librdkafka's code, retriable.

- Writes: `produce_and_wait` (produce, flush, raise unless every record was acknowledged);
  `commit_offsets` (a synchronous commit that says which partitions failed: `CommitFailed`; one kept within a
  deadline is `rollstream.infra.commits.CommitAnswers.commit`).
- Reads: `require_topics` (startup check: broker reachable, topics exist), `reader` (a consumer that
  never commits), `partitions_of`, `committed_offsets`, `watermarks`, `read_ranges`, and `is_record` /
  `position_of` for what ``consume`` returns.

Every function blocks (bounded by its timeout): call it off any event loop. A read's `timeout` is seconds or a
`Deadline` (`rollstream.infra.deadline`): a caller that makes several reads for one call passes its deadline, so
that all of them together keep it; a read that finds it passed raises at once (`time_left`). None is thread-safe for one
client; separate clients may be used from separate threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from rollstream.infra._reach import REACH_TIMEOUT_S as REACH_TIMEOUT_S  # re-exported: the startup check
from rollstream.infra._reach import require_topics as require_topics
from rollstream.infra.clients import open_consumer
from rollstream.infra.commits import raise_failures
from rollstream.infra.config import KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import (
    HINTS,
    NO_COORDINATOR,
    NO_LEADER,
    NO_TOPIC,
    NOT_AUTHORIZED,
    CommitFailed,
    KafkaIOError,
    error_text,
    kafka_error,
    missing_topic_error,
    not_authorized_error,
    where,
)
from rollstream.schemas import ConfigError

log = logging.getLogger(__name__)
_BATCH = 500
_AGAIN_S = 0.2  # before a metadata request that failed at once is sent again
BOUNDED_FETCH_BYTES = 256 * 1024  # one fetch response (compressed) of a `reader` with a read-ahead bound
_MIN_MESSAGE_MAX_BYTES = 1000  # librdkafka's least message.max.bytes
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.1, 1.0  # between attempts of a read retried within its deadline
def produce_and_wait(producer: Producer, topic: str, records: Iterable[tuple[bytes | None, bytes]], *,
                     timeout: float | Deadline, on_acked: Callable[[int, int], None] | None = None) -> int:
    """Produce each (key, value) of `records` to `topic`, flush, and return how many were acknowledged.
    `on_acked(partition, offset)` is called for each record acknowledged, in delivery order.

    Blocks at most `timeout` (seconds, or a `Deadline` the caller's call spends) in all, plus `GRACE_S`:
    waiting for room while librdkafka's queue is full, then flushing, spend the one deadline. Never call it
    on an event loop thread. Uses the caller's `producer` (its delivery settings decide what "acknowledged"
    means: acks=all for every rollstream producer); records not acknowledged when it raises stay in that
    producer's queue (the caller's to flush again or purge).

    Raises:
        KafkaIOError (retriable unless librdkafka said fatal): a record was refused, failed delivery, found
            no room in the queue or was not acknowledged within `timeout`; the message says how many of how
            many and the first error; `code` is its librdkafka name (``_TIMED_OUT`` for the deadline).
            Records not acknowledged may still have been written.
    """
    deadline = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
    acked = 0
    errors: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:  # runs in poll()/flush(), on this thread
        nonlocal acked
        if err is None:
            acked += 1
            if on_acked is not None:
                on_acked(*position_of(msg))
        else:
            errors.append(err)

    total, full = 0, False
    refused: KafkaException | None = None
    for key, value in records:
        try:
            full = not _produce(producer, topic, key, value, on_delivery, deadline)
        except KafkaException as exc:  # refused before sending (too large, unknown topic, ...)
            refused = exc
        if full or refused is not None:
            break
        total += 1
    wait_s = deadline.timeout()
    left = producer.flush() if wait_s is None else producer.flush(wait_s)
    if refused is None and not full and not errors and not left and acked == total:
        return acked
    first = errors[0] if errors else refused.args[0] if refused is not None and refused.args else None
    # Without a deadline (total_s None) flush waits for every record and the queue always finds room: no timeout.
    waited = "the queue stayed full" if full else "flush timed out"
    reason = first.str() if isinstance(first, KafkaError) else f"{waited} after {deadline.total_s:g} s"
    code = first.name() if isinstance(first, KafkaError) else "_TIMED_OUT"
    fatal = isinstance(first, KafkaError) and first.fatal()
    hint = HINTS.get(code or "", "retry; is the broker up (rollstream broker status)?")
    after = (" (and the records after a refused one)" if refused is not None
             else " (and the records that found no room in the queue in time)" if full else "")
    count = f"{total - acked} of {total}{after}"
    raise KafkaIOError(f"{count} records were not acknowledged by {topic} ({reason}); {hint}", topic=topic,
                       code=code, fatal=fatal, retriable=not fatal)


def _produce(producer: Producer, topic: str, key: bytes | None, value: bytes,
             on_delivery: Callable[[KafkaError | None, Message], None], deadline: Deadline) -> bool:
    """Produce one record; while the queue is full, serve delivery reports until there is room or `deadline`
    passed (False: not produced)."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, on_delivery=on_delivery)
            return True
        except BufferError:
            if deadline.expired:
                return False
            producer.poll(deadline.seconds(0.1))  # the queue is full: serve delivery reports until there is room


def time_left(deadline: Deadline, what: str, *, topic: str | None = None, partition: int | None = None) -> float:
    """Seconds `deadline` leaves for the next wait on librdkafka, never past it.

    Raises:
        KafkaIOError (retriable, code ``_TIMED_OUT``): the deadline has passed; the message says `what` was
            being done and what to check.
        ConfigError: `deadline` has no limit (a Kafka read is always bounded).
    """
    if deadline.total_s is None:
        raise ConfigError(f"{what}: a Kafka read needs a bounded timeout, got none")
    left = deadline.remaining()
    if left <= 0:
        # A deadline handed down with nothing left (0 s) means earlier waits of the same call spent it all.
        spent = (f"no answer within {deadline.total_s:g} s" if deadline.total_s > 0.05
                 else "no time left for it (earlier waits of the same call spent its deadline)")
        raise KafkaIOError(f"{what}: {spent}; is the broker up (rollstream broker status)? retrying may help",
                           topic=topic, partition=partition, code="_TIMED_OUT", retriable=True)
    return left


def commit_offsets(consumer: Consumer, topic: str, offsets: Mapping[int, int], *, metadata: str | None = None) -> None:
    """Commit `offsets` (partition -> offset of the next record to read) for the consumer's group, each with
    `metadata` (Kafka's per-offset metadata string; None: none) when given, synchronously.

    Blocks until the group coordinator answered: librdkafka's synchronous commit has no deadline, so a client
    that must keep one commits with `rollstream.infra.commits.CommitAnswers` instead. When it returns, every
    partition in `offsets` is committed at exactly that offset.

    Raises:
        CommitFailed: some partitions (``failed``: partition -> error) or the whole call failed
            (then ``failed`` holds every partition); ``fatal`` when librdkafka said fatal.
    """
    if not offsets:
        return
    tps = [TopicPartition(topic, p, o) if metadata is None else TopicPartition(topic, p, o, metadata)
           for p, o in sorted(offsets.items())]
    try:
        result = consumer.commit(offsets=tps, asynchronous=False)
    except KafkaException as exc:
        cause = kafka_error(f"cannot commit offsets {dict(offsets)} on {topic}", exc, topic=topic)
        raise CommitFailed(str(cause), {p: error_text(exc) for p in offsets}, topic=topic, code=cause.code,
                           fatal=cause.fatal, retriable=not cause.fatal) from exc
    raise_failures(topic, offsets, None, result or [])


def bounded_fetch(config: KafkaConfig, read_ahead_kib: int) -> dict[str, object]:
    """Consumer settings under which librdkafka holds at most `read_ahead_kib` KiB fetched ahead of what is polled
    (``queued.max.messages.kbytes``) plus one response of at most `BOUNDED_FETCH_BYTES` (never more than
    `config.max_message_bytes`, which bounds what the consumer may receive). A larger record still comes whole
    (KIP-74). The consumer defaults (`KafkaConfig.consumer`) are sized for 64 MiB rollouts: 4 MiB of compressed
    batches per partition a fetch, decompressed at once, up to 128 MiB ahead."""
    response = max(_MIN_MESSAGE_MAX_BYTES, min(BOUNDED_FETCH_BYTES, config.max_message_bytes))
    return {"queued.max.messages.kbytes": read_ahead_kib, "fetch.max.bytes": response, "message.max.bytes": response,
            "max.partition.fetch.bytes": response}


@contextmanager
def reader(config: KafkaConfig, group_id: str, *, read_ahead_kib: int | None = None) -> Iterator[Consumer]:
    """A consumer that only reads (explicit assignment, no commits, no membership); closed on exit.

    It has a group id only because librdkafka requires one (and `committed_offsets` asks for that group's).
    `read_ahead_kib`: how much librdkafka may fetch ahead of what is polled (``queued.max.messages.kbytes``;
    None: the consumer's default, twice the largest record): a long read by a slower caller (export) holds
    that much, plus one fetch response: such a reader asks for at most `BOUNDED_FETCH_BYTES` a response (a
    larger record still comes whole), since librdkafka decompresses a whole response at once, whatever the
    read-ahead (100,000 small lz4-compressed groups: 3.8 MB fetched, 78 MiB decoded, one consumer's response).
    """
    overrides: dict[str, object] = {"enable.partition.eof": False}
    if read_ahead_kib is not None:
        overrides.update(bounded_fetch(config, read_ahead_kib))
    consumer = open_consumer(config.consumer(group_id, overrides))
    try:
        yield consumer
    finally:
        consumer.close()


def partitions_of(consumer: Consumer, topic: str, *, timeout: float | Deadline) -> list[int]:
    """Partition ids of `topic`, sorted. Blocks up to `timeout` (seconds or a `Deadline`).

    Raises:
        KafkaIOError: the topic does not exist (`missing_topic_error`), or (retriable) no answer.
    """
    deadline = Deadline.of(timeout)
    while True:
        wait_s = time_left(deadline, f"cannot read the partitions of {topic}", topic=topic)
        try:
            meta = consumer.list_topics(topic, timeout=wait_s)
            break
        except KafkaException as exc:  # a dropped connection (a TLS one under load) fails at once: try again
            if not _dropped(exc) or deadline.remaining() <= _AGAIN_S:
                raise kafka_error(f"cannot read the partitions of {topic}", exc, topic=topic) from exc
            time.sleep(_AGAIN_S)
    info = meta.topics.get(topic)
    if info is not None and info.error is not None and info.error.name() in NOT_AUTHORIZED:
        raise not_authorized_error(info.error.name(), topic)
    if info is None or (info.error is not None and info.error.code() in NO_TOPIC):
        raise missing_topic_error(topic)
    if info.error is not None:
        raise kafka_error(f"cannot read the partitions of {topic}", info.error, topic=topic)
    if not info.partitions:
        raise missing_topic_error(topic)
    return sorted(info.partitions)


def _dropped(exc: KafkaException) -> bool:
    """True when librdkafka failed the request because the connection dropped (Broker transport failure)."""
    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
    return err is not None and err.code() == KafkaError._TRANSPORT


def committed_offsets(consumer: Consumer, topic: str, partitions: Sequence[int], *, timeout: float | Deadline
                      ) -> dict[int, int | None]:
    """The consumer group's committed offsets on `topic` (None where it committed nothing). Blocks up to
    `timeout` (seconds or a `Deadline`), on the calling thread: librdkafka keeps that timeout itself, and a
    lookup left running in another thread would outlive the client it uses once the caller closes it (librdkafka
    then aborts the process: ``rd_kafka_enq_once_del_source_return``).

    Raises:
        KafkaIOError: the coordinator did not answer (retriable), or refused for a partition.
    """
    found = committed_with_metadata(consumer, topic, partitions, timeout=timeout)
    return {p: offset for p, (offset, _) in found.items()}


def committed_with_metadata(consumer: Consumer, topic: str, partitions: Sequence[int], *, timeout: float | Deadline
                            ) -> dict[int, tuple[int | None, str | None]]:
    """`committed_offsets`, each with the metadata string committed with it (None: none). Blocks and
    raises as `committed_offsets` does; while the group's coordinator moves (a broker node restarting or
    stalled: ``NOT_COORDINATOR``, ``COORDINATOR_LOAD_IN_PROGRESS``) it asks again within `timeout`."""
    deadline, backoff = Deadline.of(timeout), _FIRST_BACKOFF_S
    what = f"cannot read committed offsets on {topic}"
    while True:
        try:
            tps = consumer.committed([TopicPartition(topic, p) for p in partitions],
                                     timeout=time_left(deadline, what, topic=topic))
            break
        except KafkaException as exc:
            error = kafka_error(what, exc, topic=topic)
            if error.code not in NO_COORDINATOR or deadline.remaining() <= backoff:
                raise error from exc
        time.sleep(backoff)
        backoff = min(2 * backoff, _MAX_BACKOFF_S)
    for tp in tps:
        if tp.error is not None:
            raise kafka_error(f"cannot read the committed offset of {topic}[{tp.partition}]", tp.error, topic=topic,
                              partition=tp.partition)
    return {tp.partition: (tp.offset if tp.offset >= 0 else None, tp.metadata or None) for tp in tps}


def watermarks(consumer: Consumer, topic: str, partition: int, *, timeout: float | Deadline) -> tuple[int, int]:
    """(low, high) offsets of a partition: the first stored record and one past the last. Blocks up to
    `timeout` (seconds or a `Deadline`; asks the partition leader, never the cache). While the partition has
    no leader for a moment (a broker restarting or resuming from a stall) it asks again within `timeout`.

    Raises:
        KafkaIOError: no answer (retriable), or the leader refused.
    """
    deadline, backoff = Deadline.of(timeout), _FIRST_BACKOFF_S
    what = f"cannot read the offsets of {topic}[{partition}]"
    while True:
        try:
            bounds = consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=False,
                                                    timeout=time_left(deadline, what, topic=topic, partition=partition))
        except KafkaException as exc:
            error = kafka_error(what, exc, topic=topic, partition=partition)
            if not (error.retriable or error.code in NO_LEADER) or deadline.remaining() <= backoff:
                raise error from exc
            time.sleep(backoff)
            backoff = min(2 * backoff, _MAX_BACKOFF_S)
            continue
        if bounds is None:
            raise KafkaIOError(f"cannot read the offsets of {topic}[{partition}]: the leader gave none; retrying "
                               "may help", topic=topic, partition=partition, retriable=True)
        return bounds[0], bounds[1]


def is_record(msg: Message) -> bool:
    """True for a record; False for a benign event (partition EOF) or a transient error (logged).

    Raises:
        KafkaIOError: the message is a fatal or non-retriable error (with its topic and partition).
    """
    err = msg.error()
    if err is None:
        return True
    if err.code() == KafkaError._PARTITION_EOF:
        return False
    place = where(msg.topic(), msg.partition())
    error = kafka_error(f"reading {place} failed" if place else "a Kafka read failed", err, topic=msg.topic(),
                        partition=msg.partition())
    if error.fatal or not error.retriable:
        raise error
    log.warning("transient error reading %s[%s]: %s", msg.topic(), msg.partition(), err.str())
    return False


def position_of(msg: Message) -> tuple[int, int]:
    """(partition, offset) of a record (`is_record` was True). Raises KafkaIOError for one without them."""
    partition, offset = msg.partition(), msg.offset()
    if partition is None or offset is None:
        raise KafkaIOError(f"a record from {msg.topic()} carries no partition or offset", topic=msg.topic())
    return partition, offset


def read_ranges(config: KafkaConfig, topic: str, bounds: Mapping[int, tuple[int, int]], *,
                group_id: str = "rollstream-reader", timeout: float = 30.0,
                progress: Callable[[int], None] | None = None, deadline: Deadline | None = None,
                read_ahead_kib: int | None = None) -> Iterator[Message]:
    """Yield the records of `topic` in the offset ranges [start, end) per partition, in order per partition.

    Ends are clamped to what the partition holds now; starts below the first stored offset (deleted by
    retention) are raised to it with a warning. `progress` gets the number of offsets advanced. Reads
    with a consumer of its own (`reader`): commits nothing. Blocks until done, and at most until `deadline`
    (None: none) while it reads. `read_ahead_kib`: as `reader`'s.

    Raises:
        KafkaIOError: a read failed; or (retriable) `timeout` s passed without progress, or `deadline` passed.
    """
    with reader(config, group_id, read_ahead_kib=read_ahead_kib) as consumer:
        yield from read_assigned(consumer, topic, bounds, timeout=timeout, progress=progress, deadline=deadline)


def read_assigned(consumer: Consumer, topic: str, bounds: Mapping[int, tuple[int, int]], *, timeout: float = 30.0,
                  progress: Callable[[int], None] | None = None, deadline: Deadline | None = None
                  ) -> Iterator[Message]:
    """`read_ranges` with a `reader` the caller holds: many reads, one client (a read assigns its ranges,
    replacing the last read's). Not thread-safe (the consumer is the caller's). Blocks and raises as
    `read_ranges`."""
    todo: dict[int, tuple[int, int]] = {}
    whole = Deadline.after(None) if deadline is None else deadline
    for p, (start, end) in bounds.items():
        low, high = watermarks(consumer, topic, p, timeout=whole.within(timeout))
        if start < low:
            log.warning("%s[%d]: offsets [%d, %d) were deleted (retention); starting at %d",
                        topic, p, start, low, low)
        start, end = max(start, low), min(end, high)
        if start < end:
            todo[p] = (start, end)
    if not todo:
        return
    assignment = [TopicPartition(topic, p, start) for p, (start, _) in todo.items()]
    consumer.assign(assignment)
    consumer.resume(assignment)  # a partition an earlier read finished was paused
    yield from _drain(consumer, topic, todo, timeout, progress, whole)


def _drain(consumer: Consumer, topic: str, todo: dict[int, tuple[int, int]], timeout: float,
           progress: Callable[[int], None] | None, deadline: Deadline) -> Iterator[Message]:
    nexts = {p: start for p, (start, _) in todo.items()}
    last_progress = time.monotonic()
    while todo:
        # consume() waits for all it asks for: ask for no more than is left, or every call would wait out the timeout.
        left = sum(end - nexts[p] for p, (_, end) in todo.items())
        msgs = consumer.consume(max(1, min(_BATCH, left)), timeout=deadline.seconds(min(1.0, timeout)))
        if not msgs and (time.monotonic() - last_progress > timeout or deadline.expired):
            stalled = f"for {timeout:g} s" if not deadline.expired else f"within {deadline.total_s:g} s"
            raise KafkaIOError(f"no progress reading {topic} {stalled} (still to read: "
                               + ", ".join(f"[{p}] {nexts[p]}..{e}" for p, (_, e) in todo.items())
                               + "); is the broker up (rollstream broker status)?", topic=topic, code="_TIMED_OUT",
                               retriable=True)
        for msg in msgs:
            if _unused_group_refused(msg) or not is_record(msg):
                continue
            p, offset = position_of(msg)
            if p not in todo:
                continue
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


def _unused_group_refused(msg: Message) -> bool:
    """True for the refusal of a reader's group: it never commits nor asks for committed offsets, but
    librdkafka still looks up its group's coordinator (FindCoordinator needs Describe on the group). Fetching
    with assign() needs no group ACL, so a reader goes on without one."""
    err = msg.error()
    if err is None or err.code() != KafkaError.GROUP_AUTHORIZATION_FAILED or msg.topic() is not None:
        return False
    log.debug("reader's consumer group not authorized (%s): unused, ignored", err.str())
    return True


def _done(consumer: Consumer, topic: str, todo: dict[int, tuple[int, int]], partition: int) -> None:
    todo.pop(partition, None)
    consumer.pause([TopicPartition(topic, partition)])
