"""The backpressure gate outlives a broker that stops answering: lag reads fail (timeouts, refused
connections) while the broker is down, the gate keeps its last estimate, and it follows the real lag
again once the broker is back. A dead lag thread would leave intake closed for good."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import BrokerSpec, free_port, start_broker, stop_broker
from rollstream.producers.gate import LagGate
from rollstream.producers.metrics import ProducerMetrics


async def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def test_gate_survives_a_broker_restart(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(), data_dir=tmp_path / "broker", heap_mb=384)
    config = KafkaConfig(bootstrap_servers=start_broker(spec, timeout=120))
    names = TopicNames("gate-restart")
    try:
        create_topics(TopicPlan(names=names, partitions=1), config)
        producer = Producer(config.producer())
        for i in range(3):
            producer.produce(names.rollouts, b"x", key=str(i))
        producer.flush(10)
        asyncio.run(_exercise(config, names, spec))
    finally:
        stop_broker(spec.data_dir)


async def _exercise(config: KafkaConfig, names: TopicNames, spec: BrokerSpec) -> None:
    gate = LagGate(config, "trainer", names.rollouts, max_lag=2, interval_s=0.2, metrics=ProducerMetrics())
    await gate.start()
    try:
        assert not gate.is_open()  # lag 3 > max 2
        await asyncio.to_thread(stop_broker, spec.data_dir)
        await asyncio.sleep(3.0)  # several failed reads (each bounded by its timeout)
        assert not gate.join(0), "the lag thread died on a failed read"  # join(0) is True once it ended
        assert not gate.is_open()  # the last estimate is kept
        await asyncio.to_thread(start_broker, spec, timeout=120)
        consumer = Consumer(config.consumer("trainer"))
        consumer.commit(offsets=[TopicPartition(names.rollouts, 0, 3)], asynchronous=False)
        consumer.close()
        assert await wait_for(gate.is_open, 30), "the gate never reopened after the broker came back"
    finally:
        gate.stop()
