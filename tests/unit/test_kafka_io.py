"""The one Kafka I/O layer without a broker (stand-in clients): the error mapping, produce-and-wait, commits.

Pinned here: one retriable rule (librdkafka's, or the broker did not answer); every error names its topic
and partition and carries librdkafka's error name; produce-and-wait retries a full queue within its one
deadline, counts what was not acknowledged and raises; a failed commit says which partitions failed, all
of them when the call did.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from rollstream.infra import KafkaIOError
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.kafka_errors import CommitFailed, kafka_error, missing_topic_error
from rollstream.infra.kafka_io import commit_offsets, is_record, produce_and_wait
from rollstream.infra.threads import BoundedCaller
from rollstream.schemas import RollstreamError


def test_one_retriable_rule_and_the_place_in_the_message() -> None:
    timed_out = kafka_error("cannot fetch", KafkaException(KafkaError(KafkaError._TIMED_OUT)), topic="ns.rollouts",
                            partition=2)
    assert isinstance(timed_out, RollstreamError) and timed_out.retriable and not timed_out.fatal
    assert (timed_out.topic, timed_out.partition, timed_out.code) == ("ns.rollouts", 2, "_TIMED_OUT")
    assert "ns.rollouts[2]" in str(timed_out) and "Timed out" in str(timed_out)
    too_large = kafka_error("cannot produce", KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), topic="ns.rollouts")
    assert not too_large.retriable and too_large.code == "MSG_SIZE_TOO_LARGE" and "max.message.bytes" in str(too_large)
    fatal = kafka_error("cannot commit", KafkaError(KafkaError._FATAL, fatal=True))
    assert fatal.fatal and not fatal.retriable
    # a node that left the cluster while a request waited on it (librdkafka >= 2.10; seen in `make chaos NODES=3`)
    decommissioned = kafka_error("cannot read the offsets", KafkaException(KafkaError(KafkaError._DESTROY_BROKER)))
    assert decommissioned.retriable and decommissioned.code == "_DESTROY_BROKER"
    # a group's coordinator moving while a node stalled (a trainer's start died of it in `make chaos NODES=3`)
    moving = kafka_error("cannot read committed offsets", KafkaException(KafkaError(KafkaError.NOT_COORDINATOR)))
    assert moving.retriable and moving.code == "NOT_COORDINATOR" and "coordinator is moving" in str(moving)


def test_missing_topic_names_the_command() -> None:
    err = missing_topic_error("ns.prompts", "ns")
    assert str(err) == "topic ns.prompts does not exist: run 'rollstream topics create --namespace ns' first"
    assert err.topic == "ns.prompts" and not err.retriable


class _Producer:
    def __init__(self, *, full_once: bool = False, fail: KafkaError | None = None, left: int = 0) -> None:
        self.full_once, self.fail, self.left = full_once, fail, left
        self.sent: list[tuple[bytes | None, bytes]] = []
        self.callbacks: list[Any] = []
        self.polls = 0

    def produce(self, topic: str, value: bytes, key: bytes | None, on_delivery: Any) -> None:
        if self.full_once:
            self.full_once = False
            raise BufferError("queue full")
        self.sent.append((key, value))
        self.callbacks.append(on_delivery)

    def poll(self, timeout: float) -> int:
        self.polls += 1
        return 0

    def flush(self, timeout: float) -> int:
        for i, cb in enumerate(self.callbacks[:len(self.callbacks) - self.left]):
            cb(self.fail if i == 0 else None, None)
        return self.left


def test_produce_and_wait_retries_a_full_queue_and_returns_the_count() -> None:
    producer = _Producer(full_once=True)
    assert produce_and_wait(producer, "ns.steps", [(b"k", b"1"), (None, b"2")], timeout=1.0) == 2  # type: ignore[arg-type]
    assert producer.sent == [(b"k", b"1"), (None, b"2")] and producer.polls == 1


class _FullProducer(_Producer):
    """A queue that never has room (the broker is gone and librdkafka's queue is full)."""

    def produce(self, topic: str, value: bytes, key: bytes | None, on_delivery: Any) -> None:
        raise BufferError("queue full")

    def poll(self, timeout: float) -> int:
        time.sleep(timeout)
        return super().poll(timeout)


@pytest.mark.parametrize("given", ["seconds", "deadline"])
def test_produce_and_wait_gives_up_on_a_full_queue_at_its_deadline(given: str) -> None:
    """Waiting for room spends the call's one deadline (it used to poll for ever before its flush timeout began)."""
    started = time.monotonic()
    timeout = 0.3 if given == "seconds" else Deadline.after(0.3)
    with pytest.raises(KafkaIOError, match=r"0 of 0 .*no room in the queue.*queue stayed full after 0.3") as err:
        produce_and_wait(_FullProducer(), "ns.prompts", [(None, b"a")], timeout=timeout)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.3 + GRACE_S and err.value.code == "_TIMED_OUT" and err.value.retriable


def test_produce_and_wait_raises_with_topic_count_and_first_error() -> None:
    failing = _Producer(fail=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    with pytest.raises(KafkaIOError, match=r"1 of 3 records were not acknowledged by ns.steps") as err:
        produce_and_wait(failing, "ns.steps", [(None, b"a"), (None, b"b"), (None, b"c")], timeout=1.0)  # type: ignore[arg-type]
    assert err.value.topic == "ns.steps" and err.value.code == "MSG_SIZE_TOO_LARGE"
    with pytest.raises(KafkaIOError, match="flush timed out after 1 s") as err:
        produce_and_wait(_Producer(left=2), "ns.steps", [(None, b"a"), (None, b"b")], timeout=1.0)  # type: ignore[arg-type]
    assert err.value.retriable and err.value.code == "_TIMED_OUT"


class _Consumer:
    def __init__(self, result: list[Any] | None = None, raises: KafkaException | None = None) -> None:
        self.result, self.raises = result, raises

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[Any] | None:
        if self.raises is not None:
            raise self.raises
        return self.result


class _Committed:
    def __init__(self, partition: int, error: KafkaError | None = None) -> None:
        self.partition, self.error = partition, error


def test_a_failed_commit_says_which_partitions_failed() -> None:
    bad = _Committed(1, KafkaError(KafkaError.REBALANCE_IN_PROGRESS))
    ok = _Committed(0)
    with pytest.raises(CommitFailed) as err:
        commit_offsets(_Consumer([ok, bad]), "ns.prompts", {0: 3, 1: 7})  # type: ignore[arg-type]
    assert set(err.value.failed) == {1} and err.value.partition == 1 and err.value.retriable
    whole = KafkaException(KafkaError(KafkaError._FATAL, fatal=True))
    with pytest.raises(CommitFailed) as err:
        commit_offsets(_Consumer(raises=whole), "ns.prompts", {0: 3, 1: 7})  # type: ignore[arg-type]
    assert set(err.value.failed) == {0, 1} and err.value.fatal and not err.value.retriable
    commit_offsets(_Consumer([ok]), "ns.prompts", {0: 3})  # type: ignore[arg-type]


def test_a_bounded_caller_keeps_its_thread_and_replaces_one_that_overran() -> None:
    caller = BoundedCaller("test-calls")
    try:
        first = caller.call(threading.get_ident, 5.0)
        assert first[0] and caller.call(threading.get_ident, 5.0) == first  # the same thread, kept
        with pytest.raises(ZeroDivisionError):
            caller.call(lambda: 1 // 0, 5.0)  # what the call raised, raised to the caller
        release = threading.Event()
        assert caller.call(lambda: release.wait(30), 0.2) == (False, None)  # overran: left in its thread
        finished, ident = caller.call(threading.get_ident, 5.0)
        assert finished and ident != first[1]  # a fresh thread: the overrunning one still waits
        release.set()
    finally:
        caller.close()


class _Message:
    def __init__(self, error: KafkaError | None) -> None:
        self._error = error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return "ns.rollouts"

    def partition(self) -> int:
        return 0


def test_is_record_skips_benign_events_and_raises_on_fatal_ones() -> None:
    assert is_record(_Message(None))  # type: ignore[arg-type]
    assert not is_record(_Message(KafkaError(KafkaError._PARTITION_EOF)))  # type: ignore[arg-type]
    assert not is_record(_Message(KafkaError(KafkaError._TRANSPORT)))  # type: ignore[arg-type]
    with pytest.raises(KafkaIOError, match=r"reading ns.rollouts\[0\] failed") as err:
        is_record(_Message(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))  # type: ignore[arg-type]
    assert err.value.partition == 0 and err.value.code == "TOPIC_AUTHORIZATION_FAILED"
