"""Client configuration and topic plan: one source of sizes, guarantees that cannot be overridden."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan
from rollstream.infra.config import read_properties
from rollstream.schemas import ConfigError


def test_properties_file_reaches_every_client(tmp_path: Path) -> None:
    props = tmp_path / "client.properties"
    props.write_text("# SASL over TLS\nsecurity.protocol=SASL_SSL\nsasl.mechanism: PLAIN\n\nlinger.ms = 20\n")
    config = KafkaConfig.load("broker:9093", props)
    for conf in (config.producer(), config.consumer("g"), config.admin()):
        assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.mechanism"] == "PLAIN"
        assert conf["bootstrap.servers"] == "broker:9093"
    assert config.producer()["linger.ms"] == "20"


def test_bad_properties_line_names_file_and_line(tmp_path: Path) -> None:
    props = tmp_path / "bad.properties"
    props.write_text("acks=all\nnot a property\n")
    with pytest.raises(ConfigError, match=r"bad.properties:2"):
        read_properties(props)
    with pytest.raises(ConfigError, match="cannot read"):
        read_properties(tmp_path / "missing.properties")


def test_guarantees_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match="enable.idempotence"):
        KafkaConfig("b:1", extra={"enable.idempotence": "false"}).producer()
    with pytest.raises(ConfigError, match="enable.auto.commit"):
        KafkaConfig("b:1", extra={"enable.auto.commit": "true"}).consumer("g")
    assert KafkaConfig("b:1", extra={"acks": "all"}).producer()["acks"] == "all"
    with pytest.raises(ConfigError, match="bootstrap"):
        KafkaConfig("b:1", extra={"bootstrap.servers": "x:1"})


def test_settings_that_carry_a_guarantee_are_refused_from_a_config_file(tmp_path: Path) -> None:
    """A group id in a shared file would make a trainer re-take what another group took (and the audit read
    the wrong group); auto.offset.reset=latest would make a producer skip every prompt already there."""
    for text, key in (("group.id=other\n", "group.id"), ("group.instance.id=x\n", "group.instance.id")):
        props = tmp_path / "client.properties"
        props.write_text(text)
        with pytest.raises(ConfigError, match=rf"{key}='(other|x)' cannot be set in the Kafka config") as err:
            KafkaConfig.load("b:1", props)
        assert "Remove it" in str(err.value)
    with pytest.raises(ConfigError, match="auto.offset.reset='latest' would break a rollstream guarantee"):
        KafkaConfig("b:1", extra={"auto.offset.reset": "latest"}).consumer("g")
    assert KafkaConfig("b:1", extra={"auto.offset.reset": "earliest"}).consumer("g")["auto.offset.reset"] == "earliest"


def test_client_limits_follow_the_topic_plan() -> None:
    plan = TopicPlan(max_message_bytes=20 * 1024 * 1024)
    config = plan.kafka_config(KafkaConfig("b:1"))
    producer, consumer = config.producer(), config.consumer("g")
    topic_limit = int(next(t for t in plan.topics() if t.name.endswith("rollouts")).config["max.message.bytes"])
    assert producer["message.max.bytes"] >= topic_limit
    # A fetch asks for moderate chunks; a record larger than the chunk still comes whole (KIP-74),
    # so what must admit the topic's largest record is the response limit.
    assert consumer["receive.message.max.bytes"] >= topic_limit + 512
    assert consumer["receive.message.max.bytes"] >= consumer["fetch.max.bytes"] + 512
    assert consumer["message.max.bytes"] <= consumer["fetch.max.bytes"] <= 16 * 1024 * 1024
    assert consumer["queued.max.messages.kbytes"] * 1024 >= topic_limit


def test_topic_plan_is_explicit() -> None:
    plan = TopicPlan(names=TopicNames("exp"), partitions=6, replication_factor=3, retention_days=2)
    topics = {t.name: t for t in plan.topics()}
    assert set(topics) == {"exp.prompts", "exp.rollouts", "exp.steps", "exp.control", "exp.inflight"}
    assert topics["exp.rollouts"].partitions == 6 and topics["exp.steps"].partitions == 1
    assert topics["exp.inflight"].partitions == 6 and topics["exp.inflight"].config["cleanup.policy"] == "compact"
    assert topics["exp.rollouts"].config["min.insync.replicas"] == "2"
    assert topics["exp.rollouts"].config["retention.ms"] == str(2 * 24 * 3600 * 1000)
    assert topics["exp.control"].config["cleanup.policy"] == "compact"
    with pytest.raises(ConfigError, match="min_insync_replicas"):
        TopicPlan(replication_factor=1, min_insync_replicas=2)
    with pytest.raises(ConfigError, match="namespace"):
        TopicNames("bad name!")


def test_a_bad_client_property_is_a_config_error_from_the_python_api() -> None:
    """librdkafka rejects unknown properties when a client is created; API users get ConfigError too."""
    from rollstream.consumers import RolloutConsumer
    from rollstream.infra import LagReader

    config = KafkaConfig(bootstrap_servers="127.0.0.1:1", extra={"no.such.property": "1"})
    with pytest.raises(ConfigError, match='No such configuration property: "no.such.property"'):
        LagReader(config).partitions("ns.rollouts")
    consumer = RolloutConsumer(config=config, group_id="g", namespace="ns")
    # Its first client is the admin client of the reachability check (then the consumer): either names it.
    with pytest.raises(ConfigError, match='cannot create a Kafka (consumer|admin client): No such configuration '
                                          'property: "no.such.property"'):
        consumer.take(1, timeout=0)
    consumer.close()


def test_topics_against_no_broker_fail_in_bounded_time_with_a_clear_error() -> None:
    from rollstream.infra import create_topics, describe_topic_configs
    from rollstream.schemas import RollstreamError

    from tests.conftest import free_port

    config = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}")
    with pytest.raises(RollstreamError, match="no answer from 127.0.0.1") as err:
        create_topics(TopicPlan(names=TopicNames("nobroker")), config, timeout=1.0)
    assert err.value.retriable
    with pytest.raises(RollstreamError, match="cannot describe topic nobroker.prompts"):
        describe_topic_configs(["nobroker.prompts"], config, timeout=1.0)


def test_manifest_producer_keeps_order_without_waiting_for_a_producer_id() -> None:
    conf = KafkaConfig("b:1", extra={"enable.idempotence": "true"}).manifest_producer()
    assert conf["acks"] == "all" and conf["max.in.flight.requests.per.connection"] == 1
    assert conf["enable.idempotence"] is False and conf["bootstrap.servers"] == "b:1"
