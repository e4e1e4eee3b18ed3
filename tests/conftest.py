"""Shared fixtures: one real Kafka broker per test session, and a fresh namespace per test.

The broker is ``ROLLSTREAM_BOOTSTRAP_SERVERS`` when set (a cluster, or a broker you started); else, with
``ROLLSTREAM_TEST_BROKER=docker``, the apache/kafka image through testcontainers (``tests/_docker_broker.py``,
configured as ``infra/kafka/docker-compose.yml``); else a local KRaft broker started here on a free port with
a temporary data dir and stopped at the end.
Tests isolate by namespace and consumer group, never by broker (quix-streams' topic_factory idea).
"""

from __future__ import annotations

import os
import socket
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollstream.infra import BOOTSTRAP_ENV, KafkaConfig, TopicNames, TopicPlan, create_topics


def pytest_report_header() -> str:
    """Which broker the session uses: the Kafka version matters (`make compat` runs a 3.x one)."""
    if os.environ.get(BOOTSTRAP_ENV):
        return f"kafka: {os.environ[BOOTSTRAP_ENV]} ({BOOTSTRAP_ENV})"
    if os.environ.get("ROLLSTREAM_TEST_BROKER") == "docker":
        return "kafka: the apache/kafka image (ROLLSTREAM_TEST_BROKER=docker)"
    from rollstream.infra.broker import default_kafka_version

    return f"kafka: a local Apache Kafka {default_kafka_version()} broker"


def free_port() -> int:
    """One free TCP port on 127.0.0.1 right now (nothing listens there: a client gets no answer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def bootstrap_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The session's broker: the env's, or a local one started for this run."""
    external = os.environ.get(BOOTSTRAP_ENV)
    if external:
        yield external
        return
    if os.environ.get("ROLLSTREAM_TEST_BROKER") == "docker":
        yield from _docker_broker()
        return
    from rollstream.infra.broker import BrokerSpec, start_broker, stop_broker
    from rollstream.infra.broker import free_port as free_broker_port

    data_dir = Path(tmp_path_factory.mktemp("broker"))
    bootstrap = start_broker(BrokerSpec(port=free_broker_port(), data_dir=data_dir, heap_mb=768), timeout=180.0)
    os.environ[BOOTSTRAP_ENV] = bootstrap  # subprocesses started by tests (CLI, producers) find it
    try:
        yield bootstrap
    finally:
        os.environ.pop(BOOTSTRAP_ENV, None)
        stop_broker(data_dir)


def _docker_broker() -> Iterator[str]:
    """For users with a Docker engine: the official apache/kafka image through testcontainers, removed at the end."""
    from tests._docker_broker import docker_broker

    with docker_broker(timeout=180.0) as bootstrap:
        os.environ[BOOTSTRAP_ENV] = bootstrap
        try:
            yield bootstrap
        finally:
            os.environ.pop(BOOTSTRAP_ENV, None)


@pytest.fixture(scope="session")
def freezable_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KafkaConfig, tuple[int, ...]]]:
    """A second broker, shared by the tests that freeze theirs (SIGSTOP): its config and its pids."""
    from tests.integration._kafka import freezable_broker

    yield from freezable_broker(tmp_path_factory.mktemp("freezable") / "broker")


@pytest.fixture(scope="session")
def kafka_config(bootstrap_servers: str) -> KafkaConfig:
    return KafkaConfig(bootstrap_servers=bootstrap_servers, client_id="rollstream-tests")


NamespaceFactory = Callable[..., TopicNames]


@pytest.fixture
def namespace_factory(kafka_config: KafkaConfig, request: pytest.FixtureRequest) -> NamespaceFactory:
    """Create a fresh namespace (all its topics) per call: ``namespace_factory(partitions=1)``."""

    def make(partitions: int = 3, **plan_kwargs: object) -> TopicNames:
        test = request.node.name.split("[")[0].replace("test_", "")[:40]
        names = TopicNames(f"t-{test}-{uuid.uuid4().hex[:8]}")
        create_topics(TopicPlan(names=names, partitions=partitions, **plan_kwargs), kafka_config)  # type: ignore[arg-type]
        return names

    return make


@pytest.fixture
def namespace(namespace_factory: NamespaceFactory) -> TopicNames:
    """A fresh namespace with 3 partitions per work topic."""
    return namespace_factory()


@pytest.fixture
def group_id() -> str:
    """A fresh trainer consumer group id."""
    return f"trainer-{uuid.uuid4().hex[:8]}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration/ is marked integration."""
    for item in items:
        if "integration" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.integration)


STANDINS = Path(__file__).resolve().parent / "standins"


@pytest.fixture
def slime_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """slime's stand-in (tests/standins/slime, field for field as upstream) importable as `slime`."""
    monkeypatch.syspath_prepend(str(STANDINS))
    yield
    for name in [m for m in sys.modules if m == "slime" or m.startswith("slime.")]:
        del sys.modules[name]  # the next test sees no slime again


@pytest.fixture(scope="session")
def real_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A real vLLM server (its CPU build) shared by the session (`tests.integration._vllm`)."""
    from tests.integration._vllm import real_vllm_session

    yield from real_vllm_session(tmp_path_factory)
