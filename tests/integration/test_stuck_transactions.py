"""A run's transaction that never returns keeps its caller's deadline, on a real broker.

librdkafka can hold ``send_offsets_to_transaction`` past its timeout for good after a broker stall
(librdkafka#5456; `test_call_deadlines` meets it for real, not every time). Here a transaction's write is held
on purpose (it waits on an event) so that each path runs every time: the caller is answered at its deadline
with a retriable error; a transaction that returns late is aborted (nothing it wrote is read); one that is
still stuck at the next transaction is given up on, the run fenced again with a fresh producer, and the next
transaction commits; one stuck past ``stuck_after_s`` within a longer deadline is replaced within its own call;
a run that a newer one replaced meanwhile is told it was superseded instead of fencing the newer one.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import Producer
from rollstream.infra import KafkaConfig, KafkaIOError, RunSupersededError, TopicNames
from rollstream.infra._transactions import STUCK_AFTER_S, RunTransactions
from rollstream.infra.clients import open_consumer
from rollstream.infra.deadline import GRACE_S
from rollstream.infra.runs import CONTROL_KEY, read_to_end

T = 2.0  # each transaction's timeout


def _run(config: KafkaConfig, names: TopicNames, *, leads: bool = True,
         stuck_after_s: float = STUCK_AFTER_S) -> RunTransactions:
    txn = RunTransactions(config, f"rollstream.{names.namespace}.stuck-test", topic=names.control,
                          superseded=lambda what: RunSupersededError(1, names.namespace, what),
                          renew="start again", may_refence=lambda _timeout: leads, stuck_after_s=stuck_after_s)
    txn.fence(15, "beginning the test run")
    return txn


def _committed(config: KafkaConfig, names: TopicNames) -> list[bytes]:
    """What the run's transactions committed on NS.control (a read_committed reader sees nothing else)."""
    consumer = open_consumer(config.consumer("stuck-test-reader"))
    try:
        return read_to_end(consumer, names.control, timeout=20)
    finally:
        consumer.close()


def _held(names: TopicNames, release: threading.Event, value: bytes):  # noqa: ANN202 (a write callback)
    def write(producer: Producer) -> None:
        producer.produce(names.control, value, key=CONTROL_KEY)
        release.wait(30)  # what a hung send_offsets_to_transaction does to its caller
    return write


def _write(names: TopicNames, value: bytes):  # noqa: ANN202 (a write callback)
    return lambda producer: producer.produce(names.control, value, key=CONTROL_KEY)


def _given_up(txn: RunTransactions, names: TopicNames, release: threading.Event, value: bytes) -> None:
    started = time.monotonic()
    with pytest.raises(KafkaIOError, match="did not finish the transaction within") as info:
        txn.transaction("a held write", T, _held(names, release, value))
    assert info.value.retriable and time.monotonic() - started <= T + GRACE_S


def _returns_late_and_commits_nothing(txn: RunTransactions, config: KafkaConfig, names: TopicNames,
                                      release: threading.Event, committed: bytes) -> None:
    """The stuck transaction returns at last: its producer was fenced, so nothing of it is committed, and the run
    goes on (what it committed since: `committed`, then one more write)."""
    release.set()
    time.sleep(1)
    txn.transaction("one more", T * 5, _write(names, b"more"))
    assert _committed(config, names) == [committed, b"more"]


def test_a_transaction_that_returns_late_is_aborted(kafka_config: KafkaConfig, namespace: TopicNames) -> None:
    txn, release = _run(kafka_config, namespace), threading.Event()
    try:
        _given_up(txn, namespace, release, b"late")
        release.set()  # it returns before the next transaction: aborted, and the producer is used again
        txn.transaction("the next write", T * 5, _write(namespace, b"next"))
        assert _committed(kafka_config, namespace) == [b"next"]
    finally:
        release.set()
        txn.close()


def test_a_transaction_still_stuck_is_given_up_and_the_run_fenced_again(
        kafka_config: KafkaConfig, namespace: TopicNames) -> None:
    txn, release = _run(kafka_config, namespace), threading.Event()
    try:
        _given_up(txn, namespace, release, b"stuck")
        txn.transaction("the next write", T * 5, _write(namespace, b"after"))  # a fresh producer, fenced again
        _returns_late_and_commits_nothing(txn, kafka_config, namespace, release, b"after")
    finally:
        release.set()
        txn.close()


def test_a_transaction_stuck_past_its_patience_is_replaced_within_the_call(
        kafka_config: KafkaConfig, namespace: TopicNames) -> None:
    """What a SIGKILLed transaction coordinator does to a commit with a long deadline: the call does not wait the
    deadline out, it gives the stuck transaction up after `stuck_after_s` and commits with a fresh producer."""
    patience = 1.0
    txn, release = _run(kafka_config, namespace, stuck_after_s=patience), threading.Event()
    tries: list[float] = []

    def held_once(producer: Producer) -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            _held(namespace, release, b"stuck")(producer)
        else:
            _write(namespace, b"renewed")(producer)

    try:
        started = time.monotonic()
        txn.transaction("a write whose first try is held", T * 10, held_once)
        took = time.monotonic() - started
        assert len(tries) == 2 and tries[1] - tries[0] >= patience, tries
        assert took < T * 10 / 2, f"the call waited {took:.1f} s for a transaction stuck after {patience} s"
        _returns_late_and_commits_nothing(txn, kafka_config, namespace, release, b"renewed")
    finally:
        release.set()
        txn.close()


def test_a_stuck_run_that_was_replaced_is_superseded_not_fenced_again(
        kafka_config: KafkaConfig, namespace: TopicNames) -> None:
    txn, release = _run(kafka_config, namespace, leads=False), threading.Event()
    try:
        _given_up(txn, namespace, release, b"stuck")
        with pytest.raises(RunSupersededError):
            txn.transaction("the next write", T * 5, _write(namespace, b"after"))
        assert txn.superseded
    finally:
        release.set()
        txn.close()
