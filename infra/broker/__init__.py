"""Start, stop and inspect a real local Apache Kafka broker (KRaft mode) on loopback.

The jars are resolved once by Maven from ``infra/kafka/pom.xml`` into a cache; the broker runs as
detached ``java ... kafka.Kafka`` processes that outlive the Python process that started them.
It runs the Kafka pinned there (4.x) unless ``BrokerSpec.kafka_version`` (``--kafka-version``,
``ROLLSTREAM_KAFKA_VERSION``) names another release, 3.3.0 or newer (``make compat`` runs tests on a 3.x one).

Contract (pinned by ``tests/integration/test_broker.py``):

- ``start_broker`` returns only once a client can produce (``acks=all``) to and consume from the probe
  topic ``__rollstream_probe`` and commit an offset (so the group coordinator is up too). It never hangs:
  on failure or timeout it kills what it started and raises ``BrokerError`` with the tail of the log.
- Data survives a restart with the same ``data_dir``: storage is formatted only once. A data dir may move to a
  newer Kafka version, never to an older one than last ran it (a clear error).
- Starting twice is idempotent; a port held by another process is a clear error before anything starts,
  naming the port and the flag that moves it (``--port`` or ``--controller-port``).
- ``stop_broker`` signals only the pids it recorded, and only while they are still our Kafka JVMs.
- ``BrokerSpec(sasl=True)`` (pinned by ``tests/integration/test_security.py``): clients must authenticate
  (SASL/SCRAM-SHA-512) and be authorized (StandardAuthorizer, no ACL = denied); users ``PRINCIPALS``
  (admin is the super user) with generated passwords, and ``client_config_files(data_dir)`` for each.
  A data dir keeps the mode it was formatted with.
- ``BrokerSpec(tls=True[, mtls=True])`` (pinned by ``tests/integration/test_tls.py``): every listener speaks
  TLS (``SASL_SSL`` with ``sasl``, else ``SSL``) with certificates of a local CA made at start (openssl),
  hostname verification on; the client config files trust that CA (``ssl.ca.location``) and, under mTLS,
  carry each principal's certificate (its CN is the principal). A data dir may change its TLS mode.

Ports: node ``i`` (1-based) serves clients on ``port + i - 1`` and its KRaft controller listens on
``controller_port + i - 1`` (``BrokerSpec.controller_port``, ``rollstream broker start --controller-port``;
by default ``port + 100 + i - 1``, ``CONTROLLER_PORT_OFFSET``). The controller ports are recorded in the
data dir with the pids, so status and stop need only the data dir. ``free_port(nodes)`` finds a base whose
default ranges are free; ``free_ports(nodes)`` a ``(port, controller_port)`` pair. Every node is a
combined broker+controller.

- ``restart_node(data_dir, node)`` starts one killed node of a running broker again, alone (``start_broker``
  would restart every node), and returns once that node serves (pinned by the chaos harness, ``make chaos``).

This package's ``__init__`` is the public face; the parts live in private modules: ``_spec`` (the types),
``_jars`` (Maven, Java; the pom and log4j2 config stay in ``infra/kafka/``), ``_files`` (the data dir layout,
``server.properties``, records, locks), ``_procs`` (format, spawn, signal), ``_probe`` (ports, readiness),
``_sasl`` (the SASL mode), ``_tls`` (certificates and the TLS mode).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rollstream.infra.broker._files import (
    cluster_id,
    drop_record,
    locked,
    read_record,
    recorded_controller_ports,
    rewrite_record,
    write_config,
    write_record,
)
from rollstream.infra.broker._jars import ensure_kafka_jars, find_java
from rollstream.infra.broker._probe import check_ports_free, free_port, free_ports, wait_node_serves, wait_ready
from rollstream.infra.broker._procs import format_storage, is_ours, spawn, terminate
from rollstream.infra.broker._sasl import (
    PRINCIPALS,
    client_config_path,
    credentials,
    format_args,
    server_properties,
    write_client_configs,
)
from rollstream.infra.broker._spec import (
    CONTROLLER_PORT_OFFSET,
    PROBE_TOPIC,
    BrokerError,
    BrokerSpec,
    BrokerStatus,
    default_data_dir,
    default_kafka_version,
    pinned_kafka_version,
)
from rollstream.infra.broker._tls import client_settings, ensure_certificates, listeners
from rollstream.infra.broker._tls import server_properties as tls_server_properties

__all__ = ["CONTROLLER_PORT_OFFSET", "PRINCIPALS", "PROBE_TOPIC", "BrokerError", "BrokerSpec", "BrokerStatus",
           "broker_status", "client_config_files", "default_data_dir", "default_kafka_version", "ensure_kafka_jars",
           "free_port", "free_ports",
           "restart_node", "start_broker", "stop_broker"]

log = logging.getLogger(__name__)


def start_broker(spec: BrokerSpec | None = None, *, timeout: float = 120.0) -> str:
    """Start the local broker described by ``spec`` (default ``BrokerSpec()``) and return its bootstrap.

    Blocks until a client can produce to and consume from the probe topic, at most ``timeout`` seconds
    (plus a one-time Maven resolution, see ``ensure_kafka_jars``); ~1.5 s for one node when warm.
    Idempotent: if a broker already runs for ``spec.data_dir`` with the same nodes and ports, waits
    until it serves and returns its bootstrap. Process-safe (a lock file in ``data_dir``). The JVMs are
    detached (own session) and keep running after this process exits; ``stop_broker`` ends them.

    Raises:
        BrokerError: a client or controller port is held by another process (the message names it and
            the flag that moves it); a broker with another spec (nodes, ports, host) runs for this
            data dir; the data dir holds a cluster with another node count; Java or Maven is missing;
            a node exited or the broker did not serve in time (message holds the tail of its log;
            everything started is killed first).
    """
    spec = spec if spec is not None else BrokerSpec()
    deadline = time.monotonic() + timeout
    spec.data_dir.mkdir(parents=True, exist_ok=True)
    with locked(spec.data_dir / ".lock", timeout):
        if _adopt_running(spec, deadline, timeout):
            return spec.bootstrap
        libs, java = ensure_kafka_jars(version=spec.kafka_version), find_java()
        check_ports_free(spec)
        cluster = cluster_id(spec)
        creds = credentials(spec.data_dir) if spec.sasl else None
        if spec.tls:
            ensure_certificates(spec, PRINCIPALS)
        configs = [write_config(spec, node, security) if (security := _security(spec, node, creds))
                   else write_config(spec, node) for node in range(1, spec.nodes + 1)]
        format_storage(java, libs, configs, cluster, deadline, format_args(creds) if creds else ())
        if spec.sasl or spec.tls:
            write_client_configs(spec.data_dir, {name: client_settings(
                spec.data_dir, name, sasl=spec.sasl, tls=spec.tls, mtls=spec.mtls) for name in PRINCIPALS})
        else:  # a data dir once started with --tls: its client files would no longer match the listeners
            for name in PRINCIPALS:
                client_config_path(spec.data_dir, name).unlink(missing_ok=True)
        started = time.monotonic()
        procs: list[tuple[int, Path]] = []
        try:
            for config in configs:
                procs.append((spawn(java, libs, spec.heap_mb, config, tls=spec.tls), config))
                write_record(spec, procs)  # at once: a JVM is never left running unrecorded
            wait_ready(spec, procs, deadline, timeout)
        except BaseException:
            terminate(procs, 5.0)
            drop_record(spec.data_dir)
            raise
    log.info("Kafka %s serves on %s (%d node(s), data dir %s) after %.1f s of JVM start",
             spec.kafka_version, spec.bootstrap, spec.nodes, spec.data_dir, time.monotonic() - started)
    return spec.bootstrap


def _security(spec: BrokerSpec, node: int, creds: dict[str, str] | None) -> dict[str, object] | None:
    """The ``server.properties`` entries of ``spec``'s security mode for ``node``; None for plaintext."""
    props: dict[str, object] = dict(server_properties(spec, node, creds)) if creds else {}
    if spec.tls:
        props = tls_server_properties(spec, props or listeners(spec, node))
    return props or None


def stop_broker(data_dir: Path | None = None, *, timeout: float = 30.0) -> bool:
    """Stop the broker recorded in ``data_dir`` (default ``default_data_dir()``).

    Sends SIGTERM to each recorded pid that is still our Kafka JVM (its command line names
    ``kafka.Kafka`` and its ``server.properties`` in ``data_dir``), waits up to ``timeout`` seconds for
    a clean shutdown, then SIGKILLs what is left (and waits up to 5 s more). Removes ``pids.json``.
    Returns True if a process was signalled. Raises nothing for a broker that is already gone.
    """
    directory = _resolve(data_dir)
    found = read_record(directory)
    if found is None:
        return False
    record, recorded = found
    ours = [(pid, cfg) for pid, cfg in recorded if is_ours(pid, cfg)]
    stopped = terminate(ours, timeout)
    drop_record(directory)
    if stopped:
        log.info("stopped Kafka %s (pids %s, data dir %s)", record.get("bootstrap"),
                 [pid for pid, _ in ours], directory)
    return stopped


def broker_status(data_dir: Path | None = None) -> BrokerStatus:
    """Report whether the broker recorded in ``data_dir`` runs. Does not block; opens no connection.

    ``running`` is True when every recorded pid is still our Kafka JVM; it does not prove the broker
    serves (``start_broker`` waits for that). Raises nothing.
    """
    directory = _resolve(data_dir)
    log_path = directory / "node-1" / "kafka.log"
    found = read_record(directory)
    if found is None:
        return BrokerStatus(False, None, (), 0, directory, log_path)
    record, recorded = found
    nodes = record.get("nodes", len(recorded))
    nodes = nodes if isinstance(nodes, int) else len(recorded)
    node_pids = tuple(pid if is_ours(pid, cfg) else None for pid, cfg in recorded)
    alive = tuple(pid for pid in node_pids if pid is not None)
    running = bool(alive) and len(alive) == len(recorded) == nodes
    return BrokerStatus(running, record.get("bootstrap") if running else None, alive, nodes, directory, log_path,
                        recorded_controller_ports(record), bool(record.get("sasl")), node_pids,
                        bool(record.get("tls")), bool(record.get("mtls")), _recorded_version(record))


def restart_node(data_dir: Path | None, node: int, *, timeout: float = 60.0) -> float:
    """Start node ``node`` (1-based) of the broker recorded in ``data_dir`` again, alone, on its own data and
    ``server.properties``, while the other nodes keep running; return the seconds until it served.

    For a node that was killed (a chaos test, a crash): ``start_broker`` would restart every node instead.
    Blocks until the node answers a metadata request sent to it alone and lists itself among the registered
    brokers, at most ``timeout`` seconds (plus a one-time Maven resolution, see ``ensure_kafka_jars``).
    Re-records the pids, so ``broker_status`` and ``stop_broker`` see the new JVM. Process-safe (the data
    dir's lock); the JVM is detached, as ``start_broker``'s are.

    Raises:
        BrokerError: no broker is recorded in ``data_dir`` (start one with ``start_broker``); ``node`` is not
            one of its nodes; the node still runs (kill it first, or use it); the JVM exited or did not serve
            within ``timeout`` (the message holds its log tail; the new JVM is killed; retriable on timeout).
    """
    directory = _resolve(data_dir)
    started = time.monotonic()
    if read_record(directory) is None:  # before the lock: a data dir that does not exist has no lock file
        raise BrokerError(f"no broker is recorded in {directory}: start it with start_broker "
                          f"(`rollstream broker start --data-dir {directory}`) before restarting a node")
    with locked(directory / ".lock", timeout):
        found = read_record(directory)
        if found is None:
            raise BrokerError(f"the broker of {directory} was stopped meanwhile: start it with start_broker")
        record, recorded = found
        if isinstance(node, bool) or not isinstance(node, int) or not 1 <= node <= len(recorded):
            raise BrokerError(f"node={node!r}: the broker in {directory} has nodes 1 to {len(recorded)}")
        pid, config = recorded[node - 1]
        host, port = record.get("host"), record.get("port")
        if not isinstance(host, str) or not isinstance(port, int):
            raise BrokerError(f"the record {directory / 'pids.json'} names no host and port: stop the broker "
                              "(stop_broker) and start it again with start_broker")
        if is_ours(pid, config):
            raise BrokerError(f"Kafka node {node} of {directory} still runs (pid {pid}): kill it before restarting "
                              "it, or keep using it")
        heap_mb, libs = record.get("heap_mb"), ensure_kafka_jars(version=_recorded_version(record))
        pid = spawn(find_java(), libs, heap_mb if isinstance(heap_mb, int) else 512, config,
                    tls=bool(record.get("tls")))
        recorded[node - 1] = (pid, config)
        rewrite_record(directory, record, recorded)  # at once: a JVM is never left running unrecorded
        auth = client_settings(directory, "admin", sasl=bool(record.get("sasl")), tls=bool(record.get("tls")),
                               mtls=bool(record.get("mtls")))
        try:
            wait_node_serves(node, (pid, config), host, port + node - 1, auth, started + timeout, timeout)
        except BaseException:
            terminate([(pid, config)], 5.0)
            raise
    took = time.monotonic() - started
    log.info("restarted Kafka node %d of %s (pid %d) after %.1f s", node, directory, pid, took)
    return took


def client_config_files(data_dir: Path | None = None) -> dict[str, Path]:
    """principal -> its librdkafka client config (``--kafka-config FILE``) of the SASL broker in ``data_dir``.

    Only the files that exist (a broker started with ``sasl=True`` writes one per ``PRINCIPALS``). Does not
    block; raises nothing.
    """
    directory = _resolve(data_dir)
    return {name: path for name in PRINCIPALS if (path := client_config_path(directory, name)).exists()}


def _adopt_running(spec: BrokerSpec, deadline: float, timeout: float) -> bool:
    """True if a broker for ``spec`` already runs and serves; stop and forget what is stale or partial."""
    found = read_record(spec.data_dir)
    if found is None:
        return False
    record, recorded = found
    alive = [(pid, cfg) for pid, cfg in recorded if is_ours(pid, cfg)]
    if alive and len(alive) == len(recorded) == record.get("nodes"):
        controllers = recorded_controller_ports(record)
        # No controller port asked for: whatever the running broker uses is fine.
        wanted = controllers if spec.controller_port is None else spec.controller_ports
        modes = tuple(bool(record.get(m)) for m in ("sasl", "tls", "mtls"))
        running = _recorded_version(record)
        if ((record.get("nodes"), record.get("port"), record.get("host"), controllers, modes, running)
                != (spec.nodes, spec.port, spec.host, wanted, (spec.sasl, spec.tls, spec.mtls), spec.kafka_version)):
            mode = "".join(f" with {m.upper()}" for m, on in zip(("sasl", "tls", "mtls"), modes, strict=True) if on)
            raise BrokerError(f"a {record.get('nodes')}-node Kafka {running} broker{mode} already runs for "
                              f"{spec.data_dir} on {record.get('bootstrap')} (controller ports "
                              f"{', '.join(map(str, controllers))}); use it, or stop it first (stop_broker / "
                              f"`rollstream broker stop --data-dir {spec.data_dir}`)")
        wait_ready(spec, alive, deadline, timeout)
        return True
    if alive:  # a start that died half-way: its record lists fewer nodes, or some of them exited
        log.warning("only %d of %s Kafka nodes of %s still run; restarting all", len(alive),
                    record.get("nodes"), spec.data_dir)
        terminate(alive, 10.0)
    drop_record(spec.data_dir)
    return False


def _recorded_version(record: dict[str, Any]) -> str:
    """The Kafka version in a ``pids.json`` record; one written before versions were kept ran the pinned one."""
    found = record.get("kafka_version")
    return found if isinstance(found, str) and found else pinned_kafka_version()


def _resolve(data_dir: Path | None) -> Path:
    return Path(data_dir).expanduser().resolve() if data_dir else default_data_dir().resolve()
