"""The Docker test broker (``ROLLSTREAM_TEST_BROKER=docker``): the official apache/kafka image, configured as
``infra/kafka/docker-compose.yml`` and the local broker (``infra/broker/_files.write_config``) are.

Why not testcontainers' ``KafkaContainer``: its ``with_kraft()`` rejects tags below 7.0.0 (it expects
Confluent's ``cp-kafka``, so ``apache/kafka:4.4.0`` raises ValueError), and its start script runs
``/etc/confluent/docker/{configure,launch}``, which the apache image does not have (testcontainers-python
4.15.0, ``testcontainers/community/kafka/__init__.py``; the same in 4.8's ``modules/kafka``). So this is a
generic ``DockerContainer`` that starts the way testcontainers' own Kafka containers do (Python's
``KafkaContainer.tc_start``, Java's apache ``KafkaContainer.containerIsStarting``): the container waits for
a start script, which is copied in once the host port is mapped, because Kafka must advertise that port;
the script exports ``KAFKA_ADVERTISED_LISTENERS`` and execs the image's own ``/etc/kafka/docker/run``.

The image turns each ``KAFKA_*`` variable into a ``server.properties`` line (``image_properties`` mirrors
its rule), so the settings are plain environment, compared with the compose file and the local broker by
``tests/unit/test_docker_config.py``. Everything here but ``docker_broker`` is pure and needs no Docker.
"""

from __future__ import annotations

import logging
import shlex
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient
from rollstream.infra.broker import BrokerError

log = logging.getLogger(__name__)

IMAGE = "apache/kafka:4.4.0"  # the Kafka of infra/kafka/pom.xml (a test keeps them equal)
HOST_LISTENER_PORT = 9092  # PLAINTEXT_HOST, for clients on the Docker host: advertised as the mapped port
INTERNAL_LISTENER_PORT = 19092  # PLAINTEXT, for the broker itself and other containers on its network
CONTROLLER_PORT = 9093
START_SCRIPT = "/tmp/rollstream-start.sh"
# Copied in after the script: the wait loop must not run a script that is still being written.
START_READY = "/tmp/rollstream-start.ready"
IMAGE_RUN = "/etc/kafka/docker/run"  # the apache image's CMD (docker/jvm/Dockerfile)
# KafkaRaftServer logs "[KafkaRaftServer nodeId=1] Kafka Server started" once it serves.
READY_LOG = r"Kafka Server started"
MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + 1024 * 1024  # 64 MiB records plus batch overhead, as infra/broker/

# What the apache image leaves out of server.properties (KafkaDockerWrapper.ExcludeServerPropsEnv, 4.x). It
# names KAFKA_HEAP_OPT, not KAFKA_HEAP_OPTS, so the heap setting also lands there as `heap.opts`, which Kafka
# 4.4.0 (and 4.1.1 before it) ignores without a word (checked by starting a broker from these properties).
IMAGE_EXCLUDED_ENV = frozenset({
    "KAFKA_VERSION", "KAFKA_HEAP_OPT", "KAFKA_LOG4J_OPTS", "KAFKA_OPTS", "KAFKA_JMX_OPTS",
    "KAFKA_JVM_PERFORMANCE_OPTS", "KAFKA_GC_LOG_OPTS", "KAFKA_LOG4J_ROOT_LOGLEVEL", "KAFKA_LOG4J_LOGGERS",
    "KAFKA_TOOLS_LOG4J_LOGLEVEL", "KAFKA_JMX_HOSTNAME"})


def broker_env(heap_mb: int = 768) -> dict[str, str]:
    """The container's environment, all but ``KAFKA_ADVERTISED_LISTENERS`` (see ``advertised_listeners``).

    One combined KRaft node; the settings of the local broker (``write_config``): 65 MiB message limits,
    no initial rebalance delay, 1 s minimum session timeouts, no group coordinator linger.
    """
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_LISTENERS": (f"PLAINTEXT://:{INTERNAL_LISTENER_PORT},PLAINTEXT_HOST://:{HOST_LISTENER_PORT},"
                            f"CONTROLLER://:{CONTROLLER_PORT}"),
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "PLAINTEXT:PLAINTEXT,PLAINTEXT_HOST:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": f"1@localhost:{CONTROLLER_PORT}",
        "KAFKA_LOG_DIRS": "/var/lib/kafka/data",
        "KAFKA_NUM_PARTITIONS": "1",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "false",
        "KAFKA_DEFAULT_REPLICATION_FACTOR": "1",
        "KAFKA_MIN_INSYNC_REPLICAS": "1",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_GROUP_MIN_SESSION_TIMEOUT_MS": "1000",
        "KAFKA_GROUP_CONSUMER_MIN_SESSION_TIMEOUT_MS": "1000",
        "KAFKA_GROUP_CONSUMER_SESSION_TIMEOUT_MS": "10000",
        "KAFKA_GROUP_CONSUMER_MIN_HEARTBEAT_INTERVAL_MS": "500",
        "KAFKA_GROUP_CONSUMER_HEARTBEAT_INTERVAL_MS": "2000",
        "KAFKA_GROUP_COORDINATOR_APPEND_LINGER_MS": "0",
        "KAFKA_MESSAGE_MAX_BYTES": str(MAX_MESSAGE_BYTES),
        "KAFKA_REPLICA_FETCH_MAX_BYTES": str(MAX_MESSAGE_BYTES),
        "KAFKA_REPLICA_FETCH_RESPONSE_MAX_BYTES": str(MAX_MESSAGE_BYTES),
        "KAFKA_HEAP_OPTS": f"-Xmx{heap_mb}m -Xms{heap_mb}m",
    }


def hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertised_listeners(host: str, port: int, internal_host: str = "localhost") -> str:
    """``KAFKA_ADVERTISED_LISTENERS``: clients on the Docker host at ``host:port`` (the mapped port), the
    broker itself and other containers at ``internal_host`` (a name they resolve) on the internal port."""
    return (f"PLAINTEXT://{hostport(internal_host, INTERNAL_LISTENER_PORT)},"
            f"PLAINTEXT_HOST://{hostport(host, port)}")


def wait_command() -> list[str]:
    """The container's command: wait for the start script to be complete, then run it."""
    return ["sh", "-c", f"while [ ! -f {START_READY} ]; do sleep 0.1; done; exec bash {START_SCRIPT}"]


def start_script(advertised: str) -> str:
    """The start script: export the advertised listeners, then start Kafka the apache image's way."""
    return f"#!/bin/bash\nexport KAFKA_ADVERTISED_LISTENERS={shlex.quote(advertised)}\nexec {IMAGE_RUN}\n"


def env_to_property(key: str) -> str:
    """The property the apache image writes for ``KAFKA_*`` variable ``key`` (KafkaDockerWrapper's rule:
    drop ``KAFKA_``, lower-case, ``_`` -> ``.``, ``___`` -> ``-``, ``__`` -> ``_``)."""
    return key.replace("KAFKA_", "").lower().replace("_", ".").replace("...", "-").replace("..", "_")


def image_properties(env: Mapping[str, str]) -> dict[str, str]:
    """What the apache image puts in ``server.properties`` for ``env`` (no mounted config file)."""
    return {env_to_property(key): str(value) for key, value in env.items()
            if key.startswith("KAFKA_") and key not in IMAGE_EXCLUDED_ENV}


@contextmanager
def docker_broker(timeout: float = 180.0) -> Iterator[str]:
    """Start the apache/kafka container and yield its bootstrap (``host:mapped_port``); remove it on exit.

    Blocks until Kafka logged that it started and a metadata request on the bootstrap answers with one broker
    advertised at that same address, at most ``timeout`` seconds after the container started (pulling the
    image first, once, is not counted). Not thread-safe; one container per call.

    Raises:
        BrokerError: no Docker engine answers, the container exited, Kafka did not start in time, or it
            advertises another address.
        docker.errors.DockerException: the engine refused the pull, create or start (from testcontainers).
    """
    from docker.errors import DockerException  # type: ignore[import-untyped, unused-ignore]
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.wait_strategies import LogMessageWaitStrategy

    try:
        container = DockerContainer(IMAGE)  # asks the engine for its API version now
    except DockerException as exc:
        raise BrokerError(f"ROLLSTREAM_TEST_BROKER=docker needs a Docker engine and none answered ({exc}); start "
                          "one or set DOCKER_HOST, or unset ROLLSTREAM_TEST_BROKER to test against a local broker",
                          retriable=True) from exc
    container.with_envs(**broker_env()).with_exposed_ports(HOST_LISTENER_PORT).with_command(wait_command())
    with container:
        started = time.monotonic()
        host = container.get_container_host_ip()
        port = container.get_exposed_port(HOST_LISTENER_PORT)
        bootstrap = hostport(host, port)
        container.copy_into_container(start_script(advertised_listeners(host, port)).encode(), START_SCRIPT, 0o755)
        container.copy_into_container(b"", START_READY)
        try:
            LogMessageWaitStrategy(READY_LOG).with_startup_timeout(int(timeout)).wait_until_ready(container)
        except (TimeoutError, RuntimeError) as exc:  # RuntimeError: the container exited
            raise BrokerError(f"the {IMAGE} container did not start Kafka ({exc}); its log ends:\n"
                              f"{_log_tail(container)}", retriable=isinstance(exc, TimeoutError)) from exc
        wait_advertised(bootstrap, deadline=started + timeout)
        log.info("Docker broker %s serves on %s", IMAGE, bootstrap)
        yield bootstrap


def _log_tail(container: Any, lines: int = 40) -> str:
    stdout, stderr = container.get_logs()
    return "\n".join((stdout + stderr).decode(errors="replace").splitlines()[-lines:])


def wait_advertised(bootstrap: str, deadline: float) -> None:
    """Poll metadata on ``bootstrap`` until exactly one broker answers and advertises ``bootstrap`` itself
    (what clients are sent to next), at most until ``deadline`` (``time.monotonic()``).

    Raises:
        BrokerError: no such answer by the deadline (retriable), naming the last error or the address seen.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 5000})
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            brokers = admin.list_topics(timeout=max(0.5, min(5.0, deadline - time.monotonic()))).brokers
        except KafkaException as exc:
            last = str(exc.args[0] if exc.args else exc)
            time.sleep(0.2)
            continue
        seen = sorted(hostport(str(b.host), int(b.port)) for b in brokers.values())
        if seen == [bootstrap]:
            return
        last = f"brokers advertised at {seen}"
        time.sleep(0.2)
    raise BrokerError(f"the Docker broker on {bootstrap} did not answer metadata as one broker at that address "
                      f"in time ({last}); check KAFKA_ADVERTISED_LISTENERS in {START_SCRIPT} and the container log",
                      retriable=True)
