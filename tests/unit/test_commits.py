"""A commit kept within its deadline by librdkafka's asynchronous commit (`rollstream.infra.commits`), no broker.

Pinned here, with real librdkafka clients pointed at an address where nothing listens: a commit that gets no
answer raises `CommitFailed` (``_TIMED_OUT``, retriable) by its deadline plus one polling slice, and leaves no
thread behind (nothing of it is running inside librdkafka when it returns), so the client can be replaced or
closed at once (the close bounded: librdkafka's close waits for the unanswered commit); the answer is taken
only for the offsets committed (an answer to another commit is not this one's), and a refused partition or
request raises `CommitFailed` naming it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from confluent_kafka import KafkaError, TopicPartition
from rollstream.infra import KafkaConfig
from rollstream.infra.commits import CommitAnswers, CommitClient
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import CommitFailed


def _nowhere() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def client() -> Iterator[CommitClient]:
    commits = CommitClient(KafkaConfig(bootstrap_servers=_nowhere(), extra={"log_level": 0}), "g")
    try:
        yield commits
    finally:
        commits.close(0.0)


def test_a_commit_without_an_answer_ends_by_its_deadline_and_leaves_no_call_behind(client: CommitClient) -> None:
    client.consumer.assignment()  # opened (its librdkafka threads are no calls of ours)
    threads = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(CommitFailed, match="no answer") as err:
        client.commit("ns.rollouts", {0: 5}, deadline=Deadline.after(0.5))
    took = time.monotonic() - started
    assert 0.5 <= took < 0.5 + 0.2, took  # the deadline, plus at most one polling slice
    assert err.value.code == "_TIMED_OUT" and err.value.retriable and set(err.value.failed) == {0}
    assert set(threading.enumerate()) == threads  # no thread was started: nothing is left inside librdkafka
    client.renew()  # replaced at once: the old client closes in the background, nothing of ours inside it
    with pytest.raises(CommitFailed, match="no answer"):
        client.commit("ns.rollouts", {0: 5}, deadline=Deadline.after(0.2))
    started = time.monotonic()
    assert client.close(0.5) is False  # librdkafka's close waits for the unanswered commit: bounded, no crash
    assert time.monotonic() - started < 0.5 + 0.5


@dataclass(frozen=True)
class _Answered:
    """A partition as librdkafka's answer lists it (confluent's TopicPartition.error cannot be set)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None = None


def test_only_the_answer_for_the_offsets_committed_is_taken(client: CommitClient) -> None:
    consumer, answers = client.consumer, CommitAnswers()  # its answers are fed here by hand
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
