"""The Docker paths, without Docker: the container the ``ROLLSTREAM_TEST_BROKER=docker`` fixture builds
(``tests/_docker_broker.py``) and ``infra/kafka/docker-compose.yml`` carry the local broker's settings
(``infra/broker/_files.write_config``), advertise listeners a client can follow, and use the testcontainers
API the pin in pyproject.toml admits. The one test that starts the container needs a Docker engine.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import tomllib
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
from packaging.requirements import Requirement
from rollstream.infra import KafkaConfig
from rollstream.infra.broker import BrokerSpec
from rollstream.infra.broker._files import write_config
from rollstream.infra.broker._spec import pinned_kafka_version

from tests import _docker_broker as db

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "infra" / "kafka" / "docker-compose.yml"
# Where the Docker brokers differ from the local one by design: their listeners, and paths inside the image.
BY_DESIGN = {"listeners", "advertised.listeners", "listener.security.protocol.map", "controller.quorum.voters",
             "log.dirs"}
# KAFKA_HEAP_OPTS also lands in server.properties as heap.opts: the image excludes "KAFKA_HEAP_OPT" (sic).
IMAGE_ARTIFACTS = {"heap.opts"}


def local_broker_properties(tmp_path: Path) -> dict[str, str]:
    """The server.properties ``rollstream broker start`` writes for one node (a file, no process), for the pinned
    Kafka the image runs (whatever ROLLSTREAM_KAFKA_VERSION says)."""
    spec = BrokerSpec(port=9092, data_dir=tmp_path, kafka_version=pinned_kafka_version())
    text = write_config(spec, node=1).read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def compose_document() -> dict:
    yaml = pytest.importorskip("yaml", reason="PyYAML parses the compose file (installed with the hf extra)")
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict), f"{COMPOSE} is not a YAML mapping"
    return document


def compose_env(document: dict) -> dict[str, str]:
    env = document["services"]["kafka"]["environment"]
    assert isinstance(env, dict), "compose environment must be a mapping, so each key is compared"
    return {key: str(value) for key, value in env.items()}


def listeners_by_name(value: str) -> dict[str, tuple[str, int]]:
    found = {}
    for item in value.split(","):
        name, _, address = item.partition("://")
        host, _, port = address.rpartition(":")
        found[name] = (host.strip("[]"), int(port))
    return found


def check_listeners(env: dict[str, str], advertised: str) -> dict[str, tuple[str, int]]:
    """Every advertised listener is bound, mapped to a protocol and distinct; the broker advertises its
    inter-broker listener and never its controller. Returns the advertised listeners by name."""
    bound = listeners_by_name(env["KAFKA_LISTENERS"])
    protocols = dict(p.split(":") for p in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    ads = listeners_by_name(advertised)
    assert set(bound) == set(protocols), "every listener needs a security protocol and vice versa"
    assert len({port for _, port in bound.values()}) == len(bound), f"listener ports collide: {bound}"
    assert set(ads) <= set(bound), f"advertised {set(ads)} but bound {set(bound)}"
    assert env["KAFKA_INTER_BROKER_LISTENER_NAME"] in ads
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] not in ads
    voter = env["KAFKA_CONTROLLER_QUORUM_VOTERS"].rpartition(":")[2]
    assert int(voter) == bound[env["KAFKA_CONTROLLER_LISTENER_NAMES"]][1]
    return ads


def test_image_is_the_kafka_the_local_broker_runs() -> None:
    pom = ET.parse(ROOT / "infra" / "kafka" / "pom.xml").getroot()
    version = pom.findtext("{*}properties/{*}kafka.version")
    assert db.IMAGE == f"apache/kafka:{version}"
    assert compose_document()["services"]["kafka"]["image"] == db.IMAGE


def test_env_names_become_properties_as_the_image_renders_them() -> None:
    assert db.env_to_property("KAFKA_GROUP_COORDINATOR_APPEND_LINGER_MS") == "group.coordinator.append.linger.ms"
    assert db.env_to_property("KAFKA_LISTENER_NAME_PLAINTEXT__HOST_X___Y") == "listener.name.plaintext_host.x-y"
    props = db.image_properties({"KAFKA_NODE_ID": "1", "KAFKA_OPTS": "-Dx", "CLUSTER_ID": "c", "PATH": "/bin"})
    assert props == {"node.id": "1"}


def test_fixture_carries_the_local_broker_settings(tmp_path: Path) -> None:
    docker = db.image_properties(db.broker_env())
    local = local_broker_properties(tmp_path)
    assert set(docker) - BY_DESIGN - IMAGE_ARTIFACTS == set(local) - BY_DESIGN
    differ = {k: (docker[k], local[k]) for k in set(local) - BY_DESIGN if docker[k] != local[k]}
    assert not differ, f"Docker broker (docker, local) values differ: {differ}"
    # The ones the tests rely on, spelled out.
    assert docker["group.initial.rebalance.delay.ms"] == "0"
    assert docker["group.min.session.timeout.ms"] == docker["group.consumer.min.session.timeout.ms"] == "1000"
    assert docker["group.coordinator.append.linger.ms"] == "0"


def test_message_limits_admit_the_largest_record_clients_send() -> None:
    props = db.image_properties(db.broker_env())
    limits = {props[k] for k in ("message.max.bytes", "replica.fetch.max.bytes", "replica.fetch.response.max.bytes")}
    assert limits == {str(65 * 1024 * 1024)}
    assert 65 * 1024 * 1024 >= KafkaConfig(bootstrap_servers="x:1").producer()["message.max.bytes"]


def test_fixture_advertises_the_mapped_port_after_start() -> None:
    env = db.broker_env()
    assert "KAFKA_ADVERTISED_LISTENERS" not in env, "the mapped port is only known after the container starts"
    advertised = db.advertised_listeners("localhost", 49153)
    ads = check_listeners(env, advertised)
    assert ads["PLAINTEXT_HOST"] == ("localhost", 49153)
    assert listeners_by_name(env["KAFKA_LISTENERS"])["PLAINTEXT_HOST"][1] == db.HOST_LISTENER_PORT
    assert db.advertised_listeners("::1", 5).endswith("PLAINTEXT_HOST://[::1]:5")


def test_start_script_waits_for_the_port_then_runs_the_image() -> None:
    command = db.wait_command()
    assert command[:2] == ["sh", "-c"]
    assert f"[ ! -f {db.START_READY} ]" in command[2] and command[2].endswith(f"exec bash {db.START_SCRIPT}")
    assert db.START_READY != db.START_SCRIPT  # the flag is copied after the script is whole
    advertised = db.advertised_listeners("127.0.0.1", 32768)
    lines = db.start_script(advertised).splitlines()
    assert lines[0] == "#!/bin/bash" and lines[-1] == f"exec {db.IMAGE_RUN}"
    export = shlex.split(lines[1])
    assert export == ["export", f"KAFKA_ADVERTISED_LISTENERS={advertised}"]


def test_ready_log_matches_what_kafka_raft_server_logs() -> None:
    # as Kafka 4.4.0 logged it here (a local broker started from the rendered properties)
    line = ("[2026-12-04 13:43:16,203] INFO [KafkaRaftServer nodeId=1] Kafka Server started "
            "(kafka.server.KafkaRaftServer)")
    assert re.search(db.READY_LOG, line)


def test_compose_is_the_fixture_environment_with_fixed_listeners(tmp_path: Path) -> None:
    document = compose_document()
    env = compose_env(document)
    service = document["services"]["kafka"]
    expected = {**db.broker_env(heap_mb=512),
                "KAFKA_ADVERTISED_LISTENERS": db.advertised_listeners("127.0.0.1", 9092, internal_host="kafka")}
    assert env == expected
    ads = check_listeners(env, env["KAFKA_ADVERTISED_LISTENERS"])
    # The host's clients: the published port, on loopback only, is the one advertised.
    host_ip, host_port, container_port = service["ports"][0].split(":")
    assert (host_ip, int(host_port)) == ads["PLAINTEXT_HOST"]
    assert int(container_port) == listeners_by_name(env["KAFKA_LISTENERS"])["PLAINTEXT_HOST"][1]
    # Other containers: the service name on the named network.
    assert ads["PLAINTEXT"] == ("kafka", db.INTERNAL_LISTENER_PORT)
    assert "kafka" in document["services"] and document["networks"]["default"]["name"] == "rollstream"
    header = COMPOSE.read_text().split("\nname:")[0]
    assert "group.coordinator.append.linger.ms=0" in header and "kafka:19092" in header
    assert image_and_local_agree(env, tmp_path)


def image_and_local_agree(env: dict[str, str], tmp_path: Path) -> bool:
    docker, local = db.image_properties(env), local_broker_properties(tmp_path)
    return all(docker.get(k) == v for k, v in local.items() if k not in BY_DESIGN)


def test_testcontainers_pin_admits_the_api_used() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [Requirement(r) for r in pyproject["project"]["optional-dependencies"]["dev"]]
    pin = next(r for r in pins if r.name == "testcontainers")
    assert not pin.specifier.contains("4.14.2"), "copy_into_container came in 4.15"
    assert not pin.specifier.contains("5.0.0"), "a major release may change the API"
    installed = importlib.metadata.version("testcontainers")
    assert pin.specifier.contains(installed), f"installed testcontainers {installed} is outside {pin}"
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    for name in ("with_envs", "with_exposed_ports", "with_command", "get_container_host_ip", "get_exposed_port",
                 "copy_into_container", "get_logs"):
        assert callable(getattr(DockerContainer, name)), name
    assert callable(LogMessageWaitStrategy(db.READY_LOG).with_startup_timeout)


def test_testcontainers_kafka_container_rejects_the_apache_image() -> None:
    """Why the fixture does not use KafkaContainer(...).with_kraft(): it wants a Confluent tag >= 7.0.0."""
    from testcontainers.community.kafka import KafkaContainer

    stand_in = SimpleNamespace(image=db.IMAGE, MIN_KRAFT_TAG=KafkaContainer.MIN_KRAFT_TAG)
    with pytest.raises(ValueError, match="not supported in Kraft mode"):
        KafkaContainer._verify_min_kraft_version(stand_in)  # type: ignore[arg-type]


def _no_docker() -> str | None:
    if os.environ.get("DOCKER_HOST") or Path("/var/run/docker.sock").exists():
        return None
    return "no Docker engine here: neither DOCKER_HOST nor /var/run/docker.sock"


@pytest.mark.integration
@pytest.mark.skipif(_no_docker() is not None, reason=_no_docker() or "")
def test_docker_broker_takes_a_record_over_the_default_size() -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    with db.docker_broker(timeout=180.0) as bootstrap:
        config = KafkaConfig(bootstrap_servers=bootstrap)
        topic = f"docker-{uuid.uuid4().hex[:8]}"  # no topic override: the broker's message.max.bytes applies
        admin = AdminClient(config.admin())  # kept referenced: a collected client fails its futures
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
        producer = Producer(config.producer())
        producer.produce(topic, b"x" * (3 * 1024 * 1024))  # Kafka's default limit is 1 MiB
        assert producer.flush(60) == 0
        consumer = Consumer(config.consumer(f"g-{topic}"))
        consumer.assign([TopicPartition(topic, 0, 0)])
        msg = consumer.poll(30)
        consumer.close()
        assert msg is not None and msg.error() is None and len(msg.value() or b"") == 3 * 1024 * 1024
