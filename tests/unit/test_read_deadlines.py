"""Kafka reads keep one deadline, without a broker (stand-in clients).

Pinned here: a read takes seconds or a `Deadline` (`Deadline.of`; 0 is a deadline already passed); a read whose
deadline passed raises a retriable ``_TIMED_OUT`` KafkaIOError at once, saying what to check; `watermarks`
retries a partition without a leader within its deadline and no further (no per-attempt floor), and each attempt
waits at most what is left; several reads handed one deadline spend it together.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.group_protocol import set_group_session
from rollstream.infra.kafka_io import partitions_of, time_left, watermarks
from rollstream.infra.topics import FIRST_ATTEMPT_S, in_attempts
from rollstream.schemas import ConfigError


def test_a_timeout_or_a_deadline() -> None:
    shared = Deadline.after(5)
    assert Deadline.of(shared) is shared  # a nested call spends its caller's deadline
    assert Deadline.of(0).expired and Deadline.of(None).total_s is None
    assert 2.9 < Deadline.of(3).remaining() <= 3
    with pytest.raises(ConfigError):
        Deadline.of(-1)


def test_time_left_raises_once_the_deadline_passed() -> None:
    assert 0 < time_left(Deadline.after(1), "read") <= 1
    with pytest.raises(KafkaIOError) as info:
        time_left(Deadline.of(0), "cannot read the offsets of ns.rollouts[1]", topic="ns.rollouts", partition=1)
    error = info.value
    assert error.retriable and error.code == "_TIMED_OUT" and (error.topic, error.partition) == ("ns.rollouts", 1)
    assert "no time left for it" in str(error) and "rollstream broker status" in str(error)
    with pytest.raises(ConfigError, match="bounded"):
        time_left(Deadline.of(None), "read")


class _Leaderless:
    """A consumer whose partition has no leader: every watermark query fails after waiting its timeout's tenth."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def get_watermark_offsets(self, tp: TopicPartition, cached: bool, timeout: float) -> Any:
        self.waits.append(timeout)
        time.sleep(timeout / 10)
        raise KafkaException(KafkaError(KafkaError.LEADER_NOT_AVAILABLE))

    def list_topics(self, topic: str, timeout: float) -> Any:
        raise AssertionError("not called once the deadline passed")


def test_watermarks_retry_within_the_deadline_and_no_further() -> None:
    consumer = _Leaderless()
    started = time.monotonic()
    with pytest.raises(KafkaIOError) as info:
        watermarks(consumer, "ns.rollouts", 0, timeout=0.5)  # type: ignore[arg-type]
    took = time.monotonic() - started
    assert 0.3 < took < 0.5 + GRACE_S and info.value.code == "LEADER_NOT_AVAILABLE"
    assert len(consumer.waits) > 1 and all(0 < w <= 0.5 for w in consumer.waits)
    assert consumer.waits == sorted(consumer.waits, reverse=True)  # each attempt waits what is left, no floor
    spent = Deadline.after(0.2)
    with pytest.raises(KafkaIOError):
        watermarks(consumer, "ns.rollouts", 0, timeout=spent)  # type: ignore[arg-type]
    assert spent.remaining() < 0.2  # it gave up rather than sleep past the deadline
    time.sleep(spent.remaining())
    with pytest.raises(KafkaIOError, match="no answer within 0.2 s"):  # the same deadline: nothing left for another
        partitions_of(consumer, "ns.rollouts", timeout=spent)  # type: ignore[arg-type]


def test_an_unanswered_admin_request_is_asked_again_with_a_fresh_client_while_its_timeout_lasts() -> None:
    """`in_attempts` (librdkafka's controller lookup can wait a whole timeout on one bad metadata answer): the
    first attempt waits `FIRST_ATTEMPT_S`, the next twice that, the last what is left; what answers is returned."""
    waits: list[float] = []

    def unanswered_twice(wait_s: float) -> str:
        waits.append(wait_s)
        if len(waits) < 3:
            raise KafkaIOError("no answer", code="_TIMED_OUT", retriable=True)
        return "configs"

    assert in_attempts(unanswered_twice, 60.0) == "configs"
    assert waits[:2] == [FIRST_ATTEMPT_S, 2 * FIRST_ATTEMPT_S] and waits[2] == pytest.approx(4 * FIRST_ATTEMPT_S)


def test_attempts_end_with_the_timeout_and_a_refusal_ends_them_at_once() -> None:
    waits: list[float] = []

    def never_answered(wait_s: float) -> None:
        waits.append(wait_s)
        time.sleep(wait_s)
        raise KafkaIOError(f"no answer within {wait_s:g} s", code="_TIMED_OUT", retriable=True)

    started = time.monotonic()
    with pytest.raises(KafkaIOError, match="no answer"):
        in_attempts(never_answered, 0.5)
    assert time.monotonic() - started < 0.5 + GRACE_S and len(waits) == 1 and waits[0] <= 0.5

    refused: list[float] = []

    def refuse(wait_s: float) -> None:
        refused.append(wait_s)
        raise KafkaIOError("not authorized to describe", code="TOPIC_AUTHORIZATION_FAILED", retriable=False)

    with pytest.raises(KafkaIOError, match="not authorized"):
        in_attempts(refuse, 60.0)
    assert len(refused) == 1


def test_a_consumer_protocol_groups_session_unset_by_its_timeout_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """`set_group_session` (a group's configs also go to the controller) asks in attempts within its timeout and,
    with no broker answering, warns and returns False: the producer starts with the broker's session."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there once the socket is closed
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="rollstream.infra.group_protocol"):
        assert set_group_session(KafkaConfig(bootstrap_servers=f"127.0.0.1:{port}"), "g", 6.0, timeout=1.0) is False
    assert time.monotonic() - started < 1.0 + GRACE_S
    assert "could not set its session to 6 s" in caplog.text and "no answer" in caplog.text
