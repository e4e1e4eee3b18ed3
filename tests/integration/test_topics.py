"""The topic plan against a real broker: configs read back, idempotent creation and alteration, a 20 MiB group end to
end."""

from __future__ import annotations

import numpy as np
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from rollstream.infra import (
    KafkaConfig,
    KafkaIOError,
    LagReader,
    TopicNames,
    TopicPlan,
    alter_topics,
    create_topics,
    describe_topic_configs,
)
from rollstream.schemas import ConfigError, Sample, ScoredGroup, decode, encode


def test_topics_are_created_with_the_planned_configs(kafka_config: KafkaConfig, namespace_factory) -> None:
    names = namespace_factory(partitions=2, retention_days=3)
    plan = TopicPlan(names=names, partitions=2, retention_days=3)
    assert set(create_topics(plan, kafka_config).values()) == {"exists"}  # idempotent
    configs = describe_topic_configs([names.rollouts, names.control], kafka_config)
    rollouts = configs[names.rollouts]
    assert rollouts["max.message.bytes"] == str(plan.max_message_bytes)
    assert rollouts["retention.ms"] == str(3 * 24 * 3600 * 1000)
    assert rollouts["min.insync.replicas"] == "1" and rollouts["compression.type"] == "lz4"
    assert configs[names.control]["cleanup.policy"] == "compact"
    with LagReader(kafka_config) as lag:
        assert lag.partitions(names.rollouts) == [0, 1]


def test_alter_sets_limits_as_the_plan_would_and_only_once(kafka_config: KafkaConfig, namespace_factory) -> None:
    names = namespace_factory(partitions=1, retention_days=3)
    day, mib = 24 * 3600 * 1000, 1 << 20
    changes = alter_topics(names, kafka_config, max_message_bytes=5 * mib, retention_days=2)
    timed = [names.prompts, names.rollouts, names.steps]
    assert set(changes) == {*timed, names.control, names.inflight}
    assert changes[names.rollouts] == {"max.message.bytes": (str(TopicPlan().max_message_bytes), str(5 * mib)),
                                       "retention.ms": (str(3 * day), str(2 * day))}
    assert changes[names.control] == {"max.message.bytes": (str(TopicPlan().max_message_bytes), str(5 * mib))}
    assert changes[names.inflight] == changes[names.control]  # compacted too: no retention.ms
    configs = describe_topic_configs([*timed, names.control], kafka_config)
    assert all(configs[t]["retention.ms"] == str(2 * day) for t in timed)
    assert configs[names.control]["retention.ms"] == "-1"
    assert {c["max.message.bytes"] for c in configs.values()} == {str(5 * mib)}
    assert alter_topics(names, kafka_config, max_message_bytes=5 * mib, retention_days=2) == {}  # idempotent
    assert set(alter_topics(names, kafka_config, retention_days=4)) == set(timed)  # only what is given
    with pytest.raises(ConfigError, match="give max_message_bytes or retention_days"):
        alter_topics(names, kafka_config)
    with pytest.raises(KafkaIOError):
        alter_topics(TopicNames(names.namespace + "-none"), kafka_config, retention_days=1)


def test_a_20_mib_group_crosses_the_broker(kafka_config: KafkaConfig, namespace_factory) -> None:
    names: TopicNames = namespace_factory(partitions=1)
    tokens = np.arange(20 * 1024 * 1024 // 32 + 1, dtype="<i4")  # 8 samples x 2.5 MiB of tokens > 20 MiB
    group = ScoredGroup(group_id="big#0", prompt_id="big", epoch=0, prompt_tokens=[1],
                        samples=[Sample(tokens=tokens, reward=1.0) for _ in range(8)],
                        started_at_ms=0, finished_at_ms=1)
    payload = encode(group)
    assert len(payload) > 20 * 1024 * 1024
    producer = Producer(kafka_config.producer())
    producer.produce(names.rollouts, payload, key=group.group_id)
    assert producer.flush(60) == 0
    consumer = Consumer(kafka_config.consumer("big-reader"))
    consumer.assign([TopicPartition(names.rollouts, 0, 0)])
    try:
        msg = consumer.poll(60)
        assert msg is not None and msg.error() is None, msg and msg.error()
        back = decode(msg.value(), ScoredGroup)
        assert back == group
    finally:
        consumer.close()


def test_lag_counts_uncommitted_records(kafka_config: KafkaConfig, namespace_factory) -> None:
    names = namespace_factory(partitions=2)
    producer = Producer(kafka_config.producer())
    for i in range(5):
        producer.produce(names.rollouts, b"x", key=str(i), partition=i % 2)
    producer.flush(10)
    with LagReader(kafka_config) as lag:
        assert lag.group_lag("nobody", names.rollouts).total == 5
        consumer = Consumer(kafka_config.consumer("half"))
        consumer.commit(offsets=[TopicPartition(names.rollouts, 0, 2)], asynchronous=False)
        consumer.close()
        rows = {p.partition: p for p in lag.group_lag("half", names.rollouts).partitions}
        assert rows[0].committed == 2 and rows[0].lag == 1 and rows[1].lag == 2
