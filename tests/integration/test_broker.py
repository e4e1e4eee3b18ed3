"""The local broker launcher against real Kafka JVMs (no mocks). Eight behaviours are pinned here:

1. start -> serves -> stop -> start again on the same data dir keeps the records (storage formatted once),
   and a second start of a running broker is idempotent;
2. a client or controller port held by another listening socket is a clear, immediate ``BrokerError``
   naming the port and the flag that moves it, and leaves no process;
3. three combined KRaft nodes serve a rf=3, min.insync.replicas=2 topic with acks=all, and stop takes
   every one of the three JVMs down;
4. a node that exits while starting is a ``BrokerError`` holding the cause from its log, and leaves no process;
5. ``start_broker`` keeps to its timeout even when the group coordinator never comes up (librdkafka would
   otherwise wait 45 s in each probe's commit), and leaves no process;
6. ``BrokerSpec`` rejects bad values by name, and ``rollstream.infra.broker`` exports the public names;
7. a broker started with its own controller port listens there, is reported, adopted and stopped from
   its data dir alone, and a start asking for other controller ports is refused while it runs;
8. ``restart_node`` starts a SIGKILLed node again alone, on its own data, returns once it serves and
   re-records it (status, adoption and stop see the new JVM); a running node, a node out of range and a data
   dir without a broker are a ``BrokerError`` that says what to do.

Each test uses its own ``tmp_path`` data dir and free ports (never 9092 nor ``~/.rollstream``) and stops
what it started in a ``finally``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from rollstream.infra import broker as broker_module
from rollstream.infra.broker import (
    CONTROLLER_PORT_OFFSET,
    BrokerError,
    BrokerSpec,
    broker_status,
    default_data_dir,
    free_port,
    free_ports,
    restart_node,
    start_broker,
    stop_broker,
)
from rollstream.schemas import ConfigError, RollstreamError

log = logging.getLogger(__name__)


def _kafka_pids_for(data_dir: Path) -> list[int]:
    """Live kafka.Kafka JVMs whose command line names ``data_dir`` (zombies have no command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kafka.Kafka" in cmdline and str(data_dir).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def _create_topic(bootstrap: str, topic: str, replication: int, config: dict[str, str] | None = None) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = NewTopic(topic, num_partitions=1, replication_factor=replication, config=config or {})
    admin.create_topics([new], operation_timeout=30)[topic].result(timeout=30)


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True})
    errors: list[object] = []
    for value in values:
        producer.produce(topic, value, on_delivery=lambda err, _msg: errors.append(err) if err else None)
    assert producer.flush(30) == 0
    assert errors == []


def _consume_all(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(values) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                values.append(msg.value())
        return values
    finally:
        consumer.close()


@pytest.mark.integration
def test_start_stop_restart_keeps_data(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(1), data_dir=tmp_path / "broker", heap_mb=384)
    try:
        began = time.monotonic()
        bootstrap = start_broker(spec, timeout=90)
        log.info("1-node cold start: %.1f s", time.monotonic() - began)
        assert bootstrap == f"127.0.0.1:{spec.port}"
        status = broker_status(spec.data_dir)
        assert status.running and status.bootstrap == bootstrap and status.nodes == 1 and len(status.pids) == 1
        assert status.log_path.is_file()
        assert start_broker(spec, timeout=30) == bootstrap  # idempotent: same broker, no new process
        assert broker_status(spec.data_dir).pids == status.pids

        _create_topic(bootstrap, "kept", 1)
        _produce(bootstrap, "kept", [b"survives a restart"])
        assert _consume_all(bootstrap, "kept", 1) == [b"survives a restart"]

        assert stop_broker(spec.data_dir) is True
        after = broker_status(spec.data_dir)
        assert not after.running and after.bootstrap is None and after.pids == ()
        assert _kafka_pids_for(spec.data_dir) == []
        assert stop_broker(spec.data_dir) is False  # nothing left to stop

        began = time.monotonic()
        assert start_broker(spec, timeout=90) == bootstrap
        log.info("1-node restart: %.1f s", time.monotonic() - began)
        assert _consume_all(bootstrap, "kept", 1) == [b"survives a restart"]
    finally:
        stop_broker(spec.data_dir)
    assert _kafka_pids_for(spec.data_dir) == []


@pytest.mark.integration
@pytest.mark.parametrize("custom", [False, True], ids=["default-controller-port", "custom-controller-port"])
@pytest.mark.parametrize("which", ["client", "controller"])
def test_port_taken_is_a_clear_error(tmp_path: Path, which: str, custom: bool) -> None:
    if custom:
        base, controller = free_ports(1)
    else:
        base, controller = free_port(1), None
    spec = BrokerSpec(port=base, data_dir=tmp_path / "broker", heap_mb=256, controller_port=controller)
    taken = base if which == "client" else spec.controller_ports[0]
    assert custom or which == "client" or taken == base + CONTROLLER_PORT_OFFSET
    flag = "--port" if which == "client" else "--controller-port"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        began = time.monotonic()
        try:
            with pytest.raises(BrokerError,
                               match=rf"^{which} port {taken} .*already in use.*another {flag} ") as caught:
                start_broker(spec, timeout=60)
        finally:
            stop_broker(spec.data_dir)
    assert time.monotonic() - began < 30
    assert isinstance(caught.value, RollstreamError) and "\n" not in str(caught.value)
    assert not broker_status(spec.data_dir).running
    assert _kafka_pids_for(spec.data_dir) == []


@pytest.mark.integration
def test_three_nodes_serve_min_isr_2_and_stop_completely(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(3), nodes=3, data_dir=tmp_path / "cluster", heap_mb=384)
    try:
        began = time.monotonic()
        bootstrap = start_broker(spec, timeout=90)
        log.info("3-node cold start: %.1f s", time.monotonic() - began)
        assert bootstrap == ",".join(f"127.0.0.1:{spec.port + i}" for i in range(3))
        status = broker_status(spec.data_dir)
        assert status.running and status.nodes == 3 and len(set(status.pids)) == 3
        assert len(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).brokers) == 3

        _create_topic(bootstrap, "replicated", 3, {"min.insync.replicas": "2"})
        values = [f"record-{i}".encode() for i in range(10)]
        _produce(bootstrap, "replicated", values)
        assert _consume_all(bootstrap, "replicated", len(values)) == values

        began = time.monotonic()
        assert stop_broker(spec.data_dir) is True
        log.info("3-node stop: %.1f s", time.monotonic() - began)
        assert not broker_status(spec.data_dir).running
        assert _kafka_pids_for(spec.data_dir) == []
        assert not any(Path(f"/proc/{pid}/cmdline").exists() and Path(f"/proc/{pid}/cmdline").read_bytes()
                       for pid in status.pids)
    finally:
        stop_broker(spec.data_dir)


@pytest.mark.integration
def test_a_node_that_exits_while_starting_is_reported_and_leaves_nothing(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(1), data_dir=tmp_path / "broker", heap_mb=256)
    # Storage "formatted" for another node id: the JVM exits at once with a fatal error.
    (spec.data_dir / "node-1" / "data").mkdir(parents=True)
    (spec.data_dir / "node-1" / "data" / "meta.properties").write_text(
        "version=1\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\nnode.id=7\n")
    try:
        # Kafka 4 says "Stored node id 7 doesn't match", 3.x "doesn't match stored node.id `7'".
        with pytest.raises(BrokerError, match=r"node-1 exited while starting(.|\n)*[Ss]tored node[ .]id `?7"):
            start_broker(spec, timeout=60)
    finally:
        stop_broker(spec.data_dir)
    assert not broker_status(spec.data_dir).running
    assert not (spec.data_dir / "pids.json").exists()
    assert _kafka_pids_for(spec.data_dir) == []


@pytest.mark.integration
def test_start_keeps_its_timeout_when_the_coordinator_never_comes_up(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    write_config = broker_module.write_config

    def offsets_need_three_nodes(spec: BrokerSpec, node: int) -> Path:
        config = write_config(spec, node)
        with config.open("a") as fh:  # the last value of a key wins: __consumer_offsets cannot be created
            fh.write("offsets.topic.replication.factor=3\n")
        return config

    monkeypatch.setattr(broker_module, "write_config", offsets_need_three_nodes)
    spec = BrokerSpec(port=free_port(1), data_dir=tmp_path / "broker", heap_mb=256)
    began = time.monotonic()
    try:
        with pytest.raises(BrokerError, match=r"did not serve .* within the 15 s timeout") as caught:
            start_broker(spec, timeout=15)
    finally:
        stop_broker(spec.data_dir)
    assert time.monotonic() - began < 15 + 10  # + killing the JVM; not + 45 s per probe
    assert caught.value.retriable
    assert _kafka_pids_for(spec.data_dir) == []


@pytest.mark.integration
def test_spec_rejects_bad_values_by_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for bad, name in (({"nodes": 2}, "nodes"), ({"port": 0}, "port"), ({"port": 65500}, "port"),
                      ({"heap_mb": 64}, "heap_mb"), ({"host": "localhost"}, "host"), ({"host": "0.0.0.0"}, "host"),
                      ({"controller_port": 0}, "controller_port"), ({"controller_port": True}, "controller_port"),
                      ({"controller_port": 65534, "nodes": 3}, "controller_port"),
                      ({"port": 9092, "controller_port": 9092}, "controller_port"),
                      ({"port": 9092, "nodes": 3, "controller_port": 9090}, "controller_port")):
        flag = {"port": " (--port)", "controller_port": " (--controller-port)"}.get(name, "")
        with pytest.raises(ConfigError, match=rf"BrokerSpec\.{name}=\S+{re.escape(flag)}"):
            BrokerSpec(data_dir=tmp_path, **bad)
    with pytest.raises(ConfigError, match=r"BrokerSpec\.controller_port=9093 \(--controller-port\): .*overlap"):
        BrokerSpec(data_dir=tmp_path, port=9092, nodes=3, controller_port=9093)
    high = BrokerSpec(data_dir=tmp_path, port=65500, controller_port=9192)  # its own controller port frees the top
    assert high.client_ports == (65500,) and high.controller_ports == (9192,)
    three = BrokerSpec(data_dir=tmp_path, port=9092, nodes=3, controller_port=9095)
    assert three.controller_ports == (9095, 9096, 9097)
    assert BrokerSpec(data_dir=tmp_path, port=9092, nodes=3).controller_ports == (9192, 9193, 9194)
    port, controller = free_ports(3)
    assert len({*range(port, port + 3), *range(controller, controller + 3)}) == 6
    monkeypatch.setenv("ROLLSTREAM_HOME", str(tmp_path / "home"))
    assert default_data_dir() == tmp_path / "home" / "broker"
    assert BrokerSpec().data_dir == (tmp_path / "home" / "broker").resolve()
    assert set(broker_module.__all__) == {
        "BrokerSpec", "BrokerError", "BrokerStatus", "start_broker", "stop_broker", "broker_status",
        "ensure_kafka_jars", "default_data_dir", "default_kafka_version", "free_port", "free_ports",
        "CONTROLLER_PORT_OFFSET", "PROBE_TOPIC", "PRINCIPALS", "client_config_files", "restart_node"}
    assert all(hasattr(broker_module, name) for name in broker_module.__all__)


@pytest.mark.integration
def test_a_custom_controller_port_is_used_recorded_and_stopped(tmp_path: Path) -> None:
    port, controller = free_ports(1)
    spec = BrokerSpec(port=port, controller_port=controller, data_dir=tmp_path / "broker", heap_mb=384)
    try:
        assert start_broker(spec, timeout=90) == f"127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", controller), timeout=5):
            pass  # the controller listens where it was asked to
        status = broker_status(spec.data_dir)  # the data dir alone: status and stop know no spec
        assert status.running and status.controller_ports == (controller,) and len(status.pids) == 1
        assert start_broker(spec, timeout=30) == f"127.0.0.1:{port}"  # adopted, not started twice
        assert broker_status(spec.data_dir).pids == status.pids
        # No controller port asked for: the running broker is adopted; a different one is refused.
        assert start_broker(BrokerSpec(port=port, data_dir=spec.data_dir, heap_mb=384), timeout=30) == \
            f"127.0.0.1:{port}"
        other = controller + 7 if controller + 7 != port else controller + 8
        with pytest.raises(BrokerError, match=rf"already runs .*controller ports {controller}\)"):
            start_broker(BrokerSpec(port=port, controller_port=other, data_dir=spec.data_dir, heap_mb=384),
                         timeout=30)
        _create_topic(status.bootstrap or "", "custom-controller", 1)
        _produce(status.bootstrap or "", "custom-controller", [b"served"])
        assert stop_broker(spec.data_dir) is True
        assert not broker_status(spec.data_dir).running and _kafka_pids_for(spec.data_dir) == []
    finally:
        stop_broker(spec.data_dir)
    assert _kafka_pids_for(spec.data_dir) == []


@pytest.mark.integration
def test_restart_node_brings_one_killed_node_back_on_its_data(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(1), data_dir=tmp_path / "broker", heap_mb=384)
    with pytest.raises(BrokerError, match="start it with start_broker"):
        restart_node(spec.data_dir, 1, timeout=5)
    try:
        bootstrap = start_broker(spec, timeout=90)
        _create_topic(bootstrap, "kept", 1)
        _produce(bootstrap, "kept", [b"survives a node restart"])
        with pytest.raises(BrokerError, match="still runs"):
            restart_node(spec.data_dir, 1, timeout=5)
        with pytest.raises(BrokerError, match="has nodes 1 to 1"):
            restart_node(spec.data_dir, 2, timeout=5)

        (old,) = broker_status(spec.data_dir).pids
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while broker_status(spec.data_dir).node_pids != (None,) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broker_status(spec.data_dir).node_pids == (None,)
        took = restart_node(spec.data_dir, 1, timeout=90)
        log.info("1-node restart_node: %.1f s", took)
        status = broker_status(spec.data_dir)
        assert status.running and status.pids != (old,) and status.node_pids == status.pids
        assert _consume_all(bootstrap, "kept", 1) == [b"survives a node restart"]
        assert start_broker(spec, timeout=30) == bootstrap and broker_status(spec.data_dir).pids == status.pids
    finally:
        stop_broker(spec.data_dir)
    assert _kafka_pids_for(spec.data_dir) == []
