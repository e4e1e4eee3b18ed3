"""Errors of one family: the same kind of mistake raises the same class on both sides. Three behaviours:

1. A bad argument or setting is a ``ConfigError`` on the producer and the trainer side alike (both derive
   from ``RollstreamError``, so ``except RollstreamError`` keeps catching them).
2. A call out of order (publish before ``start()``, a second ``run()``, take after ``close()``) is a
   ``LifecycleError`` that names the call to make first.
3. Nothing here needs a broker: these are checked before any client is opened.
"""

from __future__ import annotations

import asyncio

import pytest
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings
from rollstream.producers.publisher import Publisher
from rollstream.producers.service import RolloutProducer
from rollstream.schemas import ConfigError, LifecycleError, RollstreamError

NOWHERE = KafkaConfig(bootstrap_servers="127.0.0.1:1")


def test_bad_arguments_are_config_errors_on_both_sides() -> None:
    assert issubclass(ConfigError, RollstreamError) and issubclass(LifecycleError, RollstreamError)
    with pytest.raises(ConfigError, match="concurrency"):
        ProducerSettings(concurrency=0)
    with pytest.raises(ConfigError, match="group_id must be a non-empty"):
        RolloutConsumer(config=NOWHERE, group_id="")
    with pytest.raises(ConfigError, match=r"max_staleness=-1 must be >= 0"):
        RolloutConsumer(config=NOWHERE, group_id="g", max_staleness=-1)
    consumer = RolloutConsumer(config=NOWHERE, group_id="g")
    try:
        with pytest.raises(ConfigError, match=r"take\(n=0\)"):
            consumer.take(0)
        with pytest.raises(ConfigError, match=r"take\(timeout=-1\)"):
            consumer.take(1, timeout=-1)
    finally:
        consumer.close()


def test_calls_out_of_order_are_lifecycle_errors_that_say_what_to_do() -> None:
    publisher = Publisher(NOWHERE, "ns.rollouts")
    with pytest.raises(LifecycleError, match=r"before start\(\): call start\(loop\) first"):
        asyncio.run(publisher.publish(b"k", b"v"))

    consumer = RolloutConsumer(config=NOWHERE, group_id="g")
    consumer.close()
    with pytest.raises(LifecycleError, match="is closed: build a new RolloutConsumer"):
        consumer.take(1, timeout=0)


def test_a_producer_runs_once() -> None:
    async def generate(prompt: dict[str, object]) -> str:
        return "a"

    producer = RolloutProducer(generate, ProducerSettings(namespace="never"), kafka=NOWHERE)
    producer._loop = asyncio.new_event_loop()  # as if run() had started: the second run is refused at once
    try:
        with pytest.raises(LifecycleError, match="can run once; build a new producer"):
            asyncio.run(producer.run())
    finally:
        producer._loop.close()
