"""Helpers shared by the bench parts: fresh namespaces (deleted afterwards), a producer in a thread."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from confluent_kafka.admin import AdminClient
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.producers import RolloutProducer

log = logging.getLogger(__name__)
NamesFactory = Callable[..., TopicNames]


def topic_factory(config: KafkaConfig, made: list[TopicNames], prefix: str = "bench") -> NamesFactory:
    """``make(partitions=3)`` creates a fresh namespace (all its topics) and records it in `made`."""
    def make(partitions: int = 3) -> TopicNames:
        names = TopicNames(f"{prefix}-{uuid.uuid4().hex[:8]}")
        create_topics(TopicPlan(names=names, partitions=partitions), config)
        made.append(names)
        return names

    return make


def delete_topics(config: KafkaConfig, made: list[TopicNames], timeout: float = 30.0) -> None:
    """Delete every topic of the namespaces in `made` (best effort: a failure is logged, not raised)."""
    topics = [t for n in made for t in (n.prompts, n.rollouts, n.steps, n.control)]
    if not topics:
        return
    admin = AdminClient(config.admin())  # kept referenced until every future is done
    for topic, future in admin.delete_topics(topics, operation_timeout=timeout).items():
        try:
            future.result(timeout)
        except Exception as exc:  # noqa: BLE001 - cleanup of bench topics must not fail the bench
            log.warning("could not delete bench topic %s: %s", topic, exc)


def start_producer(producer: RolloutProducer, name: str) -> tuple[threading.Thread, list[BaseException]]:
    """Run `producer` in a daemon thread of its own; what it raises lands in the returned list."""
    failure: list[BaseException] = []

    def main() -> None:
        try:
            producer.run_sync(handle_signals=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller, on its thread
            failure.append(exc)

    thread = threading.Thread(target=main, name=name, daemon=True)
    thread.start()
    return thread, failure


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll `condition` every millisecond; return the `time.perf_counter()` at which it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench: {what} did not happen within {timeout:g} s")
        time.sleep(0.001)
    return time.perf_counter()


Rows = list[tuple[str, str]]


def run_standalone(run: Callable[[KafkaConfig, NamesFactory], Rows], prefix: str) -> None:
    """``python -m tests.bench.<part>``: run one part against ROLLSTREAM_BOOTSTRAP_SERVERS on fresh
    namespaces (deleted afterwards) and print its rows as a markdown table."""
    config = KafkaConfig(client_id="rollstream-bench")
    made: list[TopicNames] = []
    try:
        rows = run(config, topic_factory(config, made, prefix))
    finally:
        delete_topics(config, made)
    print("| figure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
