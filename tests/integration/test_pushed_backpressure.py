"""Backpressure pushed by the trainer: producers follow the position its consumer publishes on NS.control.

Pinned here: after every commit a `RolloutConsumer` publishes its `TrainerPosition` (committed and end
offsets) under ``position/<group>``; a paused producer whose own lag reads are 30 s apart resumes within
a second of the trainer's commit (the pushed position, not a read, opened the gate), and pauses again at
the same bound; with ``backpressure="poll"`` the same producer only learns it at its next read.
"""

from __future__ import annotations

import asyncio
import time

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig
from rollstream.infra.clients import open_consumer
from rollstream.infra.control import position_key
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.schemas import TrainerPosition, decode

from tests import plugins
from tests.integration._kafka import count, until, write_prompts
from tests.integration.test_producer_backpressure import CONCURRENCY, settings
from tests.integration.test_producer_backpressure import until as until_async
from tests.records import publish_many


def positions(kafka_config: KafkaConfig, topic: str, group: str) -> list[TrainerPosition]:
    consumer = open_consumer(kafka_config.consumer(f"{group}-reader"))
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        out: list[TrainerPosition] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                if out:
                    break
                continue
            if msg.error() is None and msg.key() == position_key(group):
                out.append(decode(msg.value(), TrainerPosition))
        return out
    finally:
        consumer.close()


def updates(producer: RolloutProducer, source: str) -> float:
    return producer.registry.get_sample_value("rollstream_producer_lag_updates_total", {"source": source}) or 0.0


def test_the_trainer_publishes_its_position_after_each_commit(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 9)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        first = c.take(4, timeout=30)
        c.take(2, timeout=30)
    found = until(lambda: (p := positions(kafka_config, names.control, group_id)) and len(p) >= 2 and p, 20,
                  "two trainer positions on NS.control")
    assert [p.step for p in found] == [0, 1] and all(p.topic == names.rollouts for p in found)
    assert found[0].committed == {p: first.offsets[p] for p in range(3)}
    assert found[-1].lag == 3  # nine published, six taken: what the trainer saw when it committed
    assert sum(found[-1].committed.values()) == 6 and sum(found[-1].ends.values()) == 9


def _paused(producer: RolloutProducer) -> bool:
    s = producer.stats()
    return s.paused and s.in_flight == 0


def _resume_seconds(kafka_config, names, group_id: str, producer: RolloutProducer) -> tuple[float, int, int]:
    """Pause the producer, then commit a step with a RolloutConsumer: seconds until it publishes again."""
    async def scenario() -> tuple[float, int, int]:
        run = asyncio.create_task(producer.run())
        await until_async(lambda: _paused(producer), what="intake to pause")
        before = producer.stats().groups_published
        with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                             filters=()) as trainer:  # the instant groups carry no reward
            await asyncio.to_thread(trainer.take, 4, 30)
            committed_at = time.monotonic()
            await until_async(lambda: producer.stats().groups_published > before, timeout_s=40, what="resume")
            resumed = time.monotonic() - committed_at
            await until_async(lambda: _paused(producer), what="pause again")
        after = producer.stats().groups_published
        producer.stop()
        await run
        return resumed, before, after

    return asyncio.run(scenario())


def test_a_paused_producer_resumes_within_a_second_of_the_trainers_commit(kafka_config, namespace_factory,
                                                                         group_id) -> None:
    names = namespace_factory(partitions=3)
    write_prompts(kafka_config, names, [f"p{i:02d}" for i in range(40)])
    slow_reads: ProducerSettings = settings(names.namespace, trainer_group=group_id, lag_interval_s=30.0,
                                            lag_fallback_s=30.0)
    producer = RolloutProducer(plugins.instant, slow_reads, kafka=kafka_config)
    resumed, before, after = _resume_seconds(kafka_config, names, group_id, producer)
    assert resumed < 1.5, f"resumed {resumed:.2f} s after the commit"  # its own next read is 30 s away
    assert updates(producer, "pushed") >= 1 and updates(producer, "read") == 0
    assert after - before <= 4 + CONCURRENCY  # the same bound: what was taken, plus what was in flight
    assert count(kafka_config, names.rollouts) == after


def test_a_polling_producer_learns_the_commit_only_at_its_next_read(kafka_config, namespace_factory,
                                                                    group_id) -> None:
    names = namespace_factory(partitions=3)
    write_prompts(kafka_config, names, [f"p{i:02d}" for i in range(40)])
    producer = RolloutProducer(plugins.instant, settings(names.namespace, trainer_group=group_id, backpressure="poll",
                                                         lag_interval_s=2.0), kafka=kafka_config)
    resumed, _, _ = _resume_seconds(kafka_config, names, group_id, producer)
    assert updates(producer, "pushed") == 0 and updates(producer, "read") >= 1
    assert 0.1 < resumed < 4.5  # up to one read interval (2 s) after the commit, plus the read itself
