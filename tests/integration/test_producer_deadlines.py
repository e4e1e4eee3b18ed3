"""The producer's start and stop, and `produce_and_wait`, keep their one deadline whatever the broker does.

Pinned here, against the session's freezable broker (`freezable_broker`) frozen with SIGSTOP, or an address nobody
listens on, each bound plus `GRACE_S`:
1. A producer asked to stop while its broker is frozen returns within ``drain_timeout_s``; the prompts it did
   not publish (or whose commit did not land) are taken again once the broker resumes: nothing is lost.
2. A producer started against an unreachable or a frozen broker fails within ``startup_timeout_s`` with a
   `RollstreamError` that says why.
3. `produce_and_wait` against a frozen broker raises within its timeout, also while librdkafka's queue is full.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest
from confluent_kafka import Producer
from rollstream.infra import KafkaConfig, KafkaIOError, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import free_port
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.kafka_io import produce_and_wait
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.schemas import RollstreamError

from tests import plugins
from tests.integration._kafka import committed_everything, count, read_all, signal_all, until, write_prompts

DRAIN_S = 2.0
STARTUP_S = 3.0


def _settings(names: TopicNames, **kwargs: object) -> ProducerSettings:
    return ProducerSettings(namespace=names.namespace, n_samples=1, concurrency=4, max_lag=10**6, lag_interval_s=0.2,
                            summary_interval_s=0, watch_control=False, session_timeout_s=6.0, **kwargs)  # type: ignore[arg-type]


def _run(producer: RolloutProducer) -> tuple[threading.Thread, list[float | BaseException]]:
    """Run `producer` in a thread; the list gets when `run` returned (or what it raised)."""
    ended: list[float | BaseException] = []

    def main() -> None:
        try:
            producer.run_sync(handle_signals=False)
            ended.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            ended.append(exc)

    runner = threading.Thread(target=main, daemon=True)
    runner.start()
    return runner, ended


@pytest.mark.timeout(120)
def test_a_producer_stops_in_time_while_its_broker_is_frozen_and_loses_nothing(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]]) -> None:
    config, pids = freezable_broker
    names = TopicNames("freeze-stop")
    create_topics(TopicPlan(names=names, partitions=2), config)
    ids = [f"p{i:02d}" for i in range(40)]
    write_prompts(config, names, ids)
    first = RolloutProducer(plugins.slow, _settings(names, drain_timeout_s=DRAIN_S), kafka=config)
    runner, ended = _run(first)
    try:
        until(lambda: count(config, names.rollouts) >= 4, 30, "some groups published before the freeze")
        signal_all(pids, signal.SIGSTOP)
        asked = time.monotonic()
        first.stop()
        runner.join(DRAIN_S + GRACE_S + 5)
        assert ended and not isinstance(ended[0], BaseException), f"run did not return cleanly: {ended}"
        assert ended[0] - asked < DRAIN_S + GRACE_S, f"stopped {ended[0] - asked:.2f} s after stop() was asked"
    finally:
        signal_all(pids, signal.SIGCONT)
    second = RolloutProducer(plugins.instant, _settings(names), kafka=config)
    runner, ended = _run(second)
    try:
        until(lambda: committed_everything(config, f"{names.namespace}.producers", names.prompts), 40,
              "every prompt committed by the second producer")
    finally:
        second.stop()
        runner.join(30)
    assert {g.prompt_id for g in read_all(config, names.rollouts)} == set(ids)  # duplicates allowed, no loss


@pytest.mark.timeout(60)
@pytest.mark.parametrize("broker", ["unreachable", "frozen"])
def test_a_producer_started_against_a_dead_broker_fails_within_its_startup_timeout(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]], broker: str) -> None:
    config, pids = freezable_broker
    names = TopicNames("freeze-start")
    if broker == "unreachable":
        config = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", extra={"log_level": 0})
    producer = RolloutProducer(plugins.instant, _settings(names, startup_timeout_s=STARTUP_S), kafka=config)
    if broker == "frozen":
        signal_all(pids, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(RollstreamError, match=f"cannot reach Kafka at {config.bootstrap_servers} within 3 s"):
            producer.run_sync(handle_signals=False)
        assert time.monotonic() - started < STARTUP_S + GRACE_S
    finally:
        signal_all(pids, signal.SIGCONT)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("queue", ["room", "full"])
def test_produce_and_wait_against_a_frozen_broker_raises_within_its_timeout(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]], queue: str) -> None:
    config, pids = freezable_broker
    names = TopicNames("freeze-produce")
    create_topics(TopicPlan(names=names, partitions=1), config)
    overrides = {"queue.buffering.max.messages": 2} if queue == "full" else {}
    producer = Producer(config.producer(overrides))
    assert produce_and_wait(producer, names.prompts, [(None, b"warm")], timeout=20.0) == 1
    signal_all(pids, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(KafkaIOError) as err:
            produce_and_wait(producer, names.prompts, [(None, b"x")] * 5, timeout=Deadline.after(2.0))
        assert time.monotonic() - started < 2.0 + GRACE_S
        assert err.value.retriable and err.value.code == "_TIMED_OUT"
        assert ("no room in the queue" in str(err.value)) == (queue == "full"), err.value
    finally:
        signal_all(pids, signal.SIGCONT)
        producer.purge()
        producer.flush(5)
