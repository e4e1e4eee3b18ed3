"""What the local broker keeps in its data dir, and how it is read and written.

Layout of ``data_dir``: ``.lock`` (held while a start runs), ``pids.json`` (what runs and on which client and
controller ports: written after each node is spawned, removed when it is stopped), ``cluster.json`` (cluster id,
node count; written once),
``node-<i>/server.properties`` (rewritten at each start), ``node-<i>/kafka.log`` (log4j2, rolled),
``node-<i>/stdout.log`` (what the JVM itself prints), ``node-<i>/data/`` (``log.dirs``).

JSON records are replaced atomically, so a concurrent reader sees the old or the new one.
"""

from __future__ import annotations

import base64
import fcntl
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollstream.infra.broker._spec import CONTROLLER_PORT_OFFSET, BrokerError, BrokerSpec, hostport, kafka_release
from rollstream.schemas import ConfigError

log = logging.getLogger(__name__)

PIDS_FILE = "pids.json"
CLUSTER_FILE = "cluster.json"
TAIL_LINES = 40
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + 1024 * 1024  # 64 MiB records plus batch overhead


def write_config(spec: BrokerSpec, node: int, security: Mapping[str, Any] | None = None) -> Path:
    """Write ``node-<node>/server.properties`` (each start, so a new port applies) and return it.

    ``security`` replaces or adds entries (the listeners, SASL and authorizer of ``BrokerSpec.sasl``).
    """
    node_dir = spec.data_dir / f"node-{node}"
    (node_dir / "data").mkdir(parents=True, exist_ok=True)
    client, controller = spec.client_ports[node - 1], spec.controller_ports[node - 1]
    rf, min_isr = spec.nodes, min(spec.nodes, 2)
    voters = ",".join(f"{i + 1}@{hostport(spec.host, p)}" for i, p in enumerate(spec.controller_ports))
    props = {
        "process.roles": "broker,controller", "node.id": node, "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{hostport(spec.host, client)},CONTROLLER://{hostport(spec.host, controller)}",
        "advertised.listeners": f"PLAINTEXT://{hostport(spec.host, client)}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT", "controller.listener.names": "CONTROLLER",
        "log.dirs": node_dir / "data", "num.partitions": 1, "auto.create.topics.enable": "false",
        "default.replication.factor": rf, "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": rf, "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr, "group.initial.rebalance.delay.ms": 0,
        "message.max.bytes": _MAX_MESSAGE_BYTES, "replica.fetch.max.bytes": _MAX_MESSAGE_BYTES,
        "replica.fetch.response.max.bytes": _MAX_MESSAGE_BYTES,
        # Tests use session.timeout.ms=6000 (classic protocol).
        "group.min.session.timeout.ms": 1000,
        **(_kafka4_properties(rf, min_isr) if spec.kafka_release >= (4, 0, 0) else {}),
        **(security or {}),
    }
    config = node_dir / "server.properties"
    config.write_text("# Written by infra/broker/ at each start; edits are overwritten.\n"
                      + "".join(f"{key}={value}\n" for key, value in props.items()))
    return config


def _kafka4_properties(rf: int, min_isr: int) -> dict[str, object]:
    """What only Kafka 4's group and share coordinators read; a 3.x broker is started without them."""
    return {
        "share.coordinator.state.topic.replication.factor": rf, "share.coordinator.state.topic.min.isr": min_isr,
        # The consumer protocol (KIP-848, on by default from 4.0) gets a 10 s session.
        "group.consumer.min.session.timeout.ms": 1000, "group.consumer.session.timeout.ms": 10000,
        "group.consumer.min.heartbeat.interval.ms": 500, "group.consumer.heartbeat.interval.ms": 2000,
        # Kafka 4's group coordinator waits up to 5 ms to batch offset-commit writes; one trainer commits
        # once per step, so there is nothing to batch and the wait is pure latency (5.5 -> 0.7 ms a commit).
        "group.coordinator.append.linger.ms": 0,
    }


def cluster_id(spec: BrokerSpec) -> str:
    """The cluster id of ``spec.data_dir`` from ``cluster.json``, created there on first use.

    It also keeps the newest Kafka version that ran the cluster: an older one cannot read what a newer one
    wrote (metadata versions only go up; 4.4's formatted storage is not forward-compatible), so a data dir
    may move to a newer ``kafka_version``, never back.

    Raises:
        BrokerError: the data dir holds a cluster with another node count, one a newer Kafka ran, or a
            cluster.json without an id.
    """
    path = spec.data_dir / CLUSTER_FILE
    meta = read_json(path)
    if meta is None:
        new_id = "-"
        while new_id.startswith("-"):  # as Kafka's Uuid.randomUuid: a leading "-" reads as a CLI flag
            new_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        write_json(path, {"cluster_id": new_id, "nodes": spec.nodes, "sasl": spec.sasl,
                          "kafka_version": spec.kafka_version})
        return new_id
    if meta.get("nodes") != spec.nodes:
        raise BrokerError(f"{spec.data_dir} holds a {meta.get('nodes')}-node cluster; start it with "
                          f"nodes={meta.get('nodes')} or use another data dir")
    if bool(meta.get("sasl", False)) != spec.sasl:
        # SCRAM users are created when storage is formatted: a cluster cannot switch modes afterwards.
        was = "with --sasl" if meta.get("sasl") else "without --sasl"
        raise BrokerError(f"{spec.data_dir} holds a cluster formatted {was}; start it {was} "
                          "or use another --data-dir")
    _check_kafka_version(spec, path, meta)
    found = meta.get("cluster_id")
    if not isinstance(found, str) or not found:
        raise BrokerError(f"{path} names no cluster_id, so the formatted nodes cannot be matched; restore it, "
                          f"or delete {spec.data_dir} to start from scratch (its topics are lost)")
    return found


def _check_kafka_version(spec: BrokerSpec, path: Path, meta: dict[str, Any]) -> None:
    """Refuse a Kafka older than the one that last ran the cluster in ``meta``; record a newer one."""
    ran = meta.get("kafka_version")
    if not isinstance(ran, str):  # written before versions were kept: the 4.x pin of then ran it
        return
    try:
        ran_release = kafka_release(ran)
    except ConfigError:
        log.warning("%s names Kafka %r, not a release; the cluster's version is not checked", path, ran)
        return
    if ran_release > spec.kafka_release:
        raise BrokerError(f"{spec.data_dir} holds a cluster that Kafka {ran} ran, and Kafka {spec.kafka_version} "
                          f"cannot read it (metadata versions only go up); start it with --kafka-version {ran} "
                          "or newer (or ROLLSTREAM_KAFKA_VERSION), or use another --data-dir")
    if ran != spec.kafka_version:
        log.info("%s: Kafka %s runs the cluster that Kafka %s ran before", spec.data_dir, spec.kafka_version, ran)
        write_json(path, {**meta, "kafka_version": spec.kafka_version})


def write_record(spec: BrokerSpec, procs: Sequence[tuple[int, Path]]) -> None:
    """Record the running nodes' pids and configs in ``pids.json`` (what stop and status read)."""
    write_json(spec.data_dir / PIDS_FILE, {
        "bootstrap": spec.bootstrap, "port": spec.port, "nodes": spec.nodes, "host": spec.host,
        "controller_ports": list(spec.controller_ports), "sasl": spec.sasl, "tls": spec.tls, "mtls": spec.mtls,
        "heap_mb": spec.heap_mb, "kafka_version": spec.kafka_version,
        "pids": [pid for pid, _ in procs], "configs": [str(config) for _, config in procs]})


def rewrite_record(data_dir: Path, record: dict[str, Any], procs: Sequence[tuple[int, Path]]) -> None:
    """``record`` (as ``read_record`` gave it) with the pids and configs of ``procs``: one node restarted."""
    write_json(data_dir / PIDS_FILE, {**record, "pids": [pid for pid, _ in procs],
                                      "configs": [str(config) for _, config in procs]})


def recorded_controller_ports(record: dict[str, Any]) -> tuple[int, ...]:
    """The controller ports in ``record``; a record written before they were kept had the default ones."""
    found = record.get("controller_ports")
    if isinstance(found, list) and all(isinstance(p, int) for p in found):
        return tuple(found)
    port, nodes = record.get("port"), record.get("nodes")
    if isinstance(port, int) and isinstance(nodes, int):
        return tuple(port + CONTROLLER_PORT_OFFSET + i for i in range(nodes))
    return ()


def read_record(data_dir: Path) -> tuple[dict[str, Any], list[tuple[int, Path]]] | None:
    """``pids.json`` and its (pid, server.properties) pairs; None when absent or unreadable."""
    path = data_dir / PIDS_FILE
    record = read_json(path)
    if record is None:
        return None
    try:
        pairs = [(int(pid), Path(cfg)) for pid, cfg in
                 zip(record.get("pids", []), record.get("configs", []), strict=False)]
    except (TypeError, ValueError):
        log.warning("ignoring %s: its pids are not integers", path)
        return None
    return record, pairs


def drop_record(data_dir: Path) -> None:
    (data_dir / PIDS_FILE).unlink(missing_ok=True)


def log_tail(node_dir: Path) -> str:
    """The JVM's own output, the first ERROR of the latest run (the cause), then the last lines."""
    parts = []
    for name, count in (("stdout.log", 10), ("kafka.log", TAIL_LINES)):
        lines = (read_text(node_dir / name) or "").splitlines()
        # Logs append across runs: the last "Log4jController" line opens the latest JVM's output.
        run = max((i for i, line in enumerate(lines) if "kafka.Log4jController" in line), default=0)
        first_error = next((i for i in range(run, len(lines)) if re.search(r"\] (ERROR|FATAL) ", lines[i])), None)
        keep = lines[-count:]
        if first_error is not None and first_error < len(lines) - count:
            keep = [*lines[first_error:first_error + 4], "[...]", *lines[-(count - 5):]]
        if keep:
            parts.append(f"--- {node_dir / name} ---\n" + "\n".join(keep))
    return "\n".join(parts) or f"(no log in {node_dir})"


def read_json(path: Path) -> dict[str, Any] | None:
    text = read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        log.warning("ignoring unreadable %s", path)
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new record


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")  # logs roll at 10 MiB, so reading one whole is fine
    except OSError:
        return None


@contextmanager
def locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; BrokerError after ``timeout`` seconds of waiting.

    The kernel drops the lock when its holder exits, so a crashed holder never leaves it stale.
    """
    deadline = time.monotonic() + timeout
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BrokerError(f"{path} stayed locked for {timeout:.0f} s by another rollstream process "
                                      "(it is starting this broker or resolving the Kafka jars); wait for it "
                                      "to finish and retry, or pass a longer timeout", retriable=True) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
