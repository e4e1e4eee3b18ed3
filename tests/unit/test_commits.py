"""A commit kept within its deadline by librdkafka's asynchronous commit (`rollstream.infra.commits`), no broker.

Pinned here, with real librdkafka clients pointed at an address where nothing listens: a commit that gets no
answer raises `CommitFailed` (``_TIMED_OUT``, retriable) by its deadline plus one polling slice, and leaves no
thread behind (nothing of it is running inside librdkafka when it returns), so the client can be closed at once
(bounded, `close_quietly`); the answer is taken only for the offsets committed (an answer to another commit is
not this one's), and a refused partition or request raises `CommitFailed` naming it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition
from rollstream.consumers._client import TrainerClient
from rollstream.infra import CommitFailed, KafkaConfig
from rollstream.infra.deadline import Deadline


def _nowhere() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def client() -> Iterator[tuple[TrainerClient, Consumer]]:
    holder = TrainerClient("g", "ns.rollouts", {"log_level": 0})
    consumer = holder.open(KafkaConfig(bootstrap_servers=_nowhere()))
    holder.use(consumer, {0: 0})
    try:
        yield holder, consumer
    finally:
        holder.close(0.0)


def test_a_commit_without_an_answer_ends_by_its_deadline_and_leaves_no_call_behind(
        client: tuple[TrainerClient, Consumer]) -> None:
    holder, consumer = client
    threads = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(CommitFailed, match="no answer") as err:
        holder.answers.commit(consumer, "ns.rollouts", {0: 5}, deadline=Deadline.after(0.5),
                              serve=lambda s: consumer.consume(10, timeout=s))
    took = time.monotonic() - started
    assert 0.5 <= took < 0.5 + 0.2, took  # the deadline, plus at most one polling slice
    assert err.value.code == "_TIMED_OUT" and err.value.retriable and set(err.value.failed) == {0}
    assert set(threading.enumerate()) == threads  # no thread was started: nothing is left inside librdkafka
    started = time.monotonic()
    holder.close(0.5)  # librdkafka's close waits for the unanswered commit: bounded, and no crash
    assert time.monotonic() - started < 0.5 + 0.5


@dataclass(frozen=True)
class _Answered:
    """A partition as librdkafka's answer lists it (confluent's TopicPartition.error cannot be set)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None


def test_only_the_answer_for_the_offsets_committed_is_taken(client: tuple[TrainerClient, Consumer]) -> None:
    holder, consumer = client
    answers = holder.answers
    replies = iter([[TopicPartition("ns.rollouts", 0, 4)], [TopicPartition("ns.rollouts", 0, 5)]])
    served: list[float] = []

    def serve(s: float) -> None:  # an answer to an earlier commit first (offset 4), then this one's (5)
        served.append(s)
        answers.on_commit(None, next(replies))

    answers.commit(consumer, "ns.rollouts", {0: 5}, deadline=Deadline.after(5.0), serve=serve)
    assert len(served) == 2 and served[0] <= 0.001  # polled in short slices first

    refused = [_Answered("ns.rollouts", 0, 3), _Answered("ns.rollouts", 1, 7, KafkaError(KafkaError.NOT_COORDINATOR))]
    with pytest.raises(CommitFailed, match="partition 1") as err:
        answers.commit(consumer, "ns.rollouts", {0: 3, 1: 7}, deadline=Deadline.after(5.0),
                       serve=lambda s: answers.on_commit(None, refused))  # type: ignore[arg-type]
    assert set(err.value.failed) == {1}
    whole = KafkaError(KafkaError.NOT_COORDINATOR)
    with pytest.raises(CommitFailed) as err:
        answers.commit(consumer, "ns.rollouts", {0: 8}, deadline=Deadline.after(5.0),
                       serve=lambda s: answers.on_commit(whole, [TopicPartition("ns.rollouts", 0, 8)]))
    assert err.value.code == "NOT_COORDINATOR" and err.value.retriable and set(err.value.failed) == {0}
