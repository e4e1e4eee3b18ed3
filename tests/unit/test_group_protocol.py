"""The prompt group's protocol settings (`rollstream.infra.group_protocol`), without a broker.

Pinned: each protocol gets its own member properties (librdkafka refuses the classic ones with
``group.protocol=consumer``, whoever supplied them, a ``--kafka-config`` file too); a bad protocol is a
ConfigError naming it; ``auto`` keeps a static member on the classic protocol without asking the broker.
"""

from __future__ import annotations

import pytest
from rollstream.infra import KafkaConfig
from rollstream.infra.clients import open_consumer
from rollstream.infra.group_protocol import CLASSIC_ONLY, group_conf, heartbeat_ms, resolve_group_protocol
from rollstream.producers import ProducerSettings
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import Intake
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import ConfigError


def test_classic_members_get_a_session_and_cooperative_sticky_assignment() -> None:
    conf = group_conf("classic", {"fetch.wait.max.ms": 100}, 10.0)
    assert conf["session.timeout.ms"] == 10_000 and conf["heartbeat.interval.ms"] == 2_500
    assert conf["partition.assignment.strategy"] == "cooperative-sticky" and conf["group.protocol"] == "classic"
    assert group_conf("classic", {"session.timeout.ms": 7000}, 10.0)["session.timeout.ms"] == 7000  # an override


def test_consumer_members_get_none_of_the_classic_properties() -> None:
    conf = group_conf("consumer", {"fetch.wait.max.ms": 100, **{key: "1" for key in CLASSIC_ONLY}}, 10.0)
    assert conf == {"fetch.wait.max.ms": 100, "group.protocol": "consumer"}
    # librdkafka accepts what is left (it refuses session.timeout.ms & co. with group.protocol=consumer).
    open_consumer(KafkaConfig(bootstrap_servers="127.0.0.1:1").consumer("g", conf)).close()


def test_heartbeats_every_quarter_session_at_least_100_ms() -> None:
    assert heartbeat_ms(2.0) == 500 and heartbeat_ms(0.2) == 100


def test_a_bad_protocol_is_named() -> None:
    with pytest.raises(ConfigError, match="group_protocol='kip848'"):
        ProducerSettings(group_protocol="kip848")  # type: ignore[arg-type]
    assert ProducerSettings().group_protocol == "auto"


def test_auto_keeps_static_members_on_the_classic_protocol_without_asking() -> None:
    unreachable = KafkaConfig(bootstrap_servers="127.0.0.1:1")
    protocol, why = resolve_group_protocol(unreachable, "auto", 0.1, static=True)
    assert protocol == "classic" and why.startswith("auto: a static member")
    assert resolve_group_protocol(unreachable, "classic", 0.1) == ("classic", "as configured")


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_intake_clients_open_under_either_protocol_whatever_the_kafka_config_file_says(protocol: str) -> None:
    kafka = KafkaConfig(bootstrap_servers="127.0.0.1:1", extra={"session.timeout.ms": "7000"})  # a --kafka-config
    metrics = ProducerMetrics()
    gate = LagGate(kafka, "trainer", "ns.rollouts", max_lag=1, interval_s=1.0, metrics=metrics)
    intake = Intake(kafka, "ns.prompts", "ns.producers", gate=gate, metrics=metrics, prefetch=2,
                    session_timeout_s=4.0, group_protocol=protocol)  # type: ignore[arg-type]
    conf = intake._client._conf
    assert conf["group.protocol"] == protocol
    assert conf.get("session.timeout.ms") == (4000 if protocol == "classic" else None)  # the typed setting wins
    intake._client.open().close()  # librdkafka accepts it
