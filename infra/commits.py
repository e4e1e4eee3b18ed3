"""A consumer group's offset commits kept within a deadline by librdkafka's asynchronous commit: no call left behind.

librdkafka's synchronous commit waits for the group coordinator's answer with no deadline (a client that lost its
coordinator, confluentinc/librdkafka#5511, would hold its caller for ever), and running it in a thread that is
abandoned on a timeout leaves a call inside librdkafka that a later replacement or close of the client races with.
So a commit here is ``consumer.commit(offsets=..., asynchronous=True)``, which returns at once, and its answer comes
through the consumer's ``on_commit`` callback (`CommitAnswers.on_commit`, given to the client when it is opened).

librdkafka serves that callback only from the consumer's own queue, i.e. from ``poll()``/``consume()``, which also
hand out the records the client fetched. So the commits go through a client of their own (`CommitClient`): a
consumer of the group that is assigned nothing, so polling it hands out no record, and the client that fetches
is never polled behind its owner's back (its records would pile up in the process or be lost). Pausing the
fetching client's assignment instead was weighed and not taken: librdkafka's pause drops what it already
fetched (a version barrier) and fetches it again on resume, at every commit. Kafka takes a commit of explicit
offsets from any client of the group when no member is subscribed (partitions are assigned here).

librdkafka's poll serves the answer and goes on waiting for a record until its timeout, so the wait polls in
slices: 1 ms ones for the first `_FAST_S` (a healthy coordinator answers in a few milliseconds: the answer costs
under a millisecond more), then slices doubling up to 100 ms (a stalled one is not polled a thousand times a
second), and one that gets no answer costs at most what is left of its `Deadline` (plus the last slice's
wake-up). When it returns or raises, no call of it is inside librdkafka; a commit that got no answer in time may
still land later (librdkafka keeps it until the coordinator answers), which callers allow for. Closing a client
whose commit is still unanswered waits for it inside librdkafka (up to a minute, or for good without a
coordinator): `CommitClient.close` bounds that wait and leaves the close to its thread, the only call on it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from rollstream.infra._replaceable import close_quietly
from rollstream.infra.clients import open_consumer
from rollstream.infra.config import KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import CommitFailed, error_text, kafka_error
from rollstream.schemas import LifecycleError

log = logging.getLogger(__name__)

_FIRST_SLICE_S = 0.001
_FAST_S = 0.1  # how long the wait polls in slices of _FIRST_SLICE_S before they grow
_MAX_SLICE_S = 0.1
CommitKey = tuple[tuple[str, int, int], ...]
CommitAnswer = tuple[KafkaError | None, list[TopicPartition]]


def _key(tps: Sequence[TopicPartition]) -> CommitKey:
    return tuple(sorted((tp.topic, tp.partition, tp.offset) for tp in tps))


class CommitAnswers:
    """The answers to one client's asynchronous commits. Give `on_commit` as the consumer's ``on_commit``
    property (`conf`) when it is opened. Thread-safe: librdkafka calls `on_commit` on whichever thread polls or
    closes the client. Only the answer to the newest commit is kept (`commit` forgets older ones)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answers: dict[CommitKey, CommitAnswer] = {}

    def conf(self) -> dict[str, object]:
        """The consumer property that routes the client's commit answers here."""
        return {"on_commit": self.on_commit}

    def on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's answer to a commit of `partitions` (`err`: the whole request's error, if any)."""
        with self._lock:
            self._answers[_key(partitions)] = (err, list(partitions))

    def send(self, consumer: Consumer, topic: str, offsets: Mapping[int, int], *, metadata: str | None = None
             ) -> CommitKey:
        """Send a commit of `offsets` (partition -> offset of the next record to read), each with `metadata` when
        given, asynchronously; return its key for `answer`. Never blocks. Forgets the answers to earlier commits.

        Raises:
            CommitFailed: librdkafka refused to send it (no answer will come).
        """
        tps = [TopicPartition(topic, p, o) if metadata is None else TopicPartition(topic, p, o, metadata)
               for p, o in sorted(offsets.items())]
        with self._lock:
            self._answers.clear()  # answers to earlier commits (timed out, or of a replaced client) say nothing new
        try:
            consumer.commit(offsets=tps, asynchronous=True)
        except KafkaException as exc:
            cause = kafka_error(f"cannot commit offsets {dict(offsets)} on {topic}", exc, topic=topic)
            raise CommitFailed(str(cause), {p: error_text(exc) for p in offsets}, topic=topic, code=cause.code,
                               fatal=cause.fatal, retriable=not cause.fatal) from exc
        return _key(tps)

    def answer(self, key: CommitKey) -> CommitAnswer | None:
        """The answer to the commit sent as `key`, once its client was polled after it came (then forgotten);
        None: none yet. Raise it with `raise_failures`. Never blocks."""
        with self._lock:
            return self._answers.pop(key, None)

    def commit(self, consumer: Consumer, topic: str, offsets: Mapping[int, int], *, deadline: Deadline,
               serve: Callable[[float], None], metadata: str | None = None) -> None:
        """Commit `offsets` (partition -> offset of the next record to read) for the consumer's group, each with
        `metadata` when given, asynchronously, and wait for the answer by calling ``serve(seconds)`` (which must
        poll `consumer` without losing a record it hands out) until it came or `deadline` passed.

        Blocks at most what is left of `deadline` plus one slice (<= 0.1 s). When it returns, every partition in
        `offsets` is committed at exactly that offset. Not thread-safe for one consumer (one commit at a time).

        Raises:
            CommitFailed: librdkafka refused the commit, the coordinator failed some partitions (``failed``), or
                no answer came in time (code ``_TIMED_OUT``: it may still land; retrying is safe).
        """
        if not offsets:
            return
        key = self.send(consumer, topic, offsets, metadata=metadata)
        answer = self._wait(key, deadline, serve)
        if answer is None:
            raise unanswered(topic, offsets, deadline.total_s or 0)
        raise_failures(topic, offsets, *answer)

    def _wait(self, key: CommitKey, deadline: Deadline, serve: Callable[[float], None]) -> CommitAnswer | None:
        slice_s, grow_after = _FIRST_SLICE_S, deadline.remaining() - _FAST_S
        while True:
            answer = self.answer(key)
            if answer is not None:
                return answer
            left = deadline.remaining()
            if left <= 0:
                return None
            serve(min(slice_s, left))
            if left < grow_after:
                slice_s = min(2 * slice_s, _MAX_SLICE_S)


class CommitClient:
    """The client through which `group_id` commits and reads its committed offsets: a consumer assigned nothing,
    whose commits are asynchronous (see the module docstring). Not thread-safe (one owner thread); no network
    call until used (`consumer`).

    `renew` puts a fresh client in its place (one that lost its coordinator never finds it again,
    confluentinc/librdkafka#5511) and closes the old one in the background: no call of the owner is inside it
    then, since every call returns within its deadline.
    """

    def __init__(self, config: KafkaConfig, group_id: str) -> None:
        self._config, self.group_id = config, group_id
        self._answers = CommitAnswers()  # one for every client it opens: each commit forgets older answers
        self._consumer: Consumer | None = None
        self._closed = False

    @property
    def consumer(self) -> Consumer:
        """The client (opened on first use), for reads of the group's committed offsets and its group metadata.
        Raises LifecycleError once closed; ConfigError for a bad property."""
        if self._closed:
            raise LifecycleError(f"the commit client of group {self.group_id} is closed")
        if self._consumer is None:
            self._consumer = open_consumer(self._config.consumer(
                self.group_id, {"enable.partition.eof": False, **self._answers.conf()}))
        return self._consumer

    def commit(self, topic: str, offsets: Mapping[int, int], *, deadline: Deadline, metadata: str | None = None
               ) -> None:
        """`CommitAnswers.commit` through this client: blocks at most what is left of `deadline` plus 0.1 s.
        Raises CommitFailed as it says."""
        self._answers.commit(self.consumer, topic, offsets, deadline=deadline, serve=self._serve, metadata=metadata)

    def _serve(self, wait_s: float) -> None:
        # Assigned nothing: what poll hands out is an error event at most, which the commit's answer reports.
        event = self.consumer.poll(wait_s)
        if event is not None and event.error() is not None:
            log.debug("commit client of group %s: %s", self.group_id, event.error())

    def renew(self) -> None:
        """Open a fresh client on next use and close this one in the background (waiting for nothing)."""
        old, self._consumer = self._consumer, None
        if old is not None:
            close_quietly(old.close, f"commits-{self.group_id}")

    def close(self, wait_s: float) -> bool:
        """Close the client, waiting at most `wait_s` (librdkafka waits for a commit still unanswered; such a
        close is left to its thread, the only call on the client). Idempotent. Returns whether it closed in time."""
        self._closed = True
        old, self._consumer = self._consumer, None
        if old is None or close_quietly(old.close, f"commits-{self.group_id}", wait_s=wait_s):
            return True
        log.warning("the commit client of group %s did not close within %g s (a commit without an answer); left "
                    "to the process", self.group_id, wait_s)
        return False


def unanswered(topic: str, offsets: Mapping[int, int], waited_s: float) -> CommitFailed:
    """The error of a commit of `offsets` that got no answer within `waited_s` (it may still land)."""
    return CommitFailed(f"commit of offsets {dict(offsets)} on {topic} got no answer from the group coordinator "
                        f"within {waited_s:g} s; it may still land; retrying is safe (is the broker up? rollstream "
                        "broker status)", {p: "timed out" for p in offsets}, topic=topic, code="_TIMED_OUT")


def raise_failures(topic: str, offsets: Mapping[int, int], err: KafkaError | None,
                   partitions: Sequence[TopicPartition]) -> None:
    """Raise `CommitFailed` when a commit's answer (`err` for the whole request, else each partition's error)
    says it failed; return when every partition was committed."""
    if err is not None:
        cause = kafka_error(f"cannot commit offsets {dict(offsets)} on {topic}", KafkaException(err), topic=topic)
        raise CommitFailed(str(cause), {p: err.str() for p in offsets}, topic=topic, code=cause.code,
                           fatal=cause.fatal, retriable=not cause.fatal)
    failed = {tp.partition: str(tp.error) for tp in partitions if tp.error is not None}
    if failed:
        detail = ", ".join(f"partition {p}: {e}" for p, e in sorted(failed.items()))
        raise CommitFailed(f"cannot commit offsets on {topic}: {detail}; retrying may help", failed, topic=topic)
