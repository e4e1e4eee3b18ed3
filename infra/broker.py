"""Start, stop and inspect a real local Apache Kafka 4.x broker (KRaft mode) on loopback.

The jars are resolved once by Maven from ``infra/kafka/pom.xml`` into a cache; the broker runs as
detached ``java ... kafka.Kafka`` processes that outlive the Python process that started them.

Contract (pinned by ``tests/integration/test_broker.py``):

- ``start_broker`` returns only once a client can produce (``acks=all``) to and consume from the probe
  topic ``__rollstream_probe`` and commit an offset (so the group coordinator is up too). It never hangs:
  on failure or timeout it kills what it started and raises ``BrokerError`` with the tail of the log.
- Data survives a restart with the same ``data_dir``: storage is formatted only once.
- Starting twice is idempotent; a port held by another process is a clear error before anything starts.
- ``stop_broker`` signals only the pids it recorded, and only while they are still our Kafka JVMs.

Ports: node ``i`` (1-based) serves clients on ``port + i - 1`` and its KRaft controller listens on
``port + 100 + i - 1`` (``CONTROLLER_PORT_OFFSET``). Every node is a combined broker+controller.

Layout of ``data_dir``: ``pids.json`` (what runs), ``cluster.json`` (cluster id, node count),
``node-<i>/server.properties``, ``node-<i>/kafka.log`` (log4j2, rolled), ``node-<i>/stdout.log`` (what
the JVM itself prints), ``node-<i>/data/`` (``log.dirs``).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from schemas._errors import ConfigError, RollstreamError

__all__ = ["BrokerError", "BrokerSpec", "BrokerStatus", "broker_status", "default_data_dir",
           "ensure_kafka_jars", "start_broker", "stop_broker"]

log = logging.getLogger(__name__)

CONTROLLER_PORT_OFFSET = 100
PROBE_TOPIC = "__rollstream_probe"
_KAFKA_DIR = Path(__file__).resolve().parent / "kafka"
_POM = _KAFKA_DIR / "pom.xml"
_LOG4J = _KAFKA_DIR / "log4j2.properties"
_MVN_TIMEOUT = 900.0  # first resolution downloads ~60 MB from Maven Central
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + 1024 * 1024  # 64 MiB records plus batch overhead
_TAIL_LINES = 40
# Serial GC and C1 only: the JVM serves in ~1.5 s on two cores instead of ~2.5 s with G1 + C2.
_JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:+ExitOnOutOfMemoryError",
              "-Djava.awt.headless=true")


def default_data_dir() -> Path:
    """``$ROLLSTREAM_HOME/broker`` if ``ROLLSTREAM_HOME`` is set, else ``~/.rollstream/broker``."""
    home = os.environ.get("ROLLSTREAM_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".rollstream") / "broker"


class BrokerError(RollstreamError):
    """The local broker cannot be resolved, started, reached or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerSpec:
    """What to start. ``nodes=3`` gives three combined KRaft nodes (rf 3, min.insync.replicas 2)."""

    port: int = 9092
    nodes: Literal[1, 3] = 1
    data_dir: Path = field(default_factory=default_data_dir)
    heap_mb: int = 512
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or self.nodes not in (1, 3):
            raise ConfigError(f"BrokerSpec.nodes={self.nodes!r}: must be 1 or 3")
        top = self.port + CONTROLLER_PORT_OFFSET + self.nodes - 1 if isinstance(self.port, int) else 0
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= top <= 65535:
            raise ConfigError(f"BrokerSpec.port={self.port!r}: must be an int with port+"
                              f"{CONTROLLER_PORT_OFFSET + self.nodes - 1} <= 65535 (controller ports)")
        if isinstance(self.heap_mb, bool) or not isinstance(self.heap_mb, int) or self.heap_mb < 128:
            raise ConfigError(f"BrokerSpec.heap_mb={self.heap_mb!r}: must be an int >= 128")
        try:
            unspecified = ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            unspecified = True
        if unspecified:
            raise ConfigError(f"BrokerSpec.host={self.host!r}: must be one IP address such as 127.0.0.1")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())

    @property
    def client_ports(self) -> tuple[int, ...]:
        return tuple(self.port + i for i in range(self.nodes))

    @property
    def controller_ports(self) -> tuple[int, ...]:
        return tuple(p + CONTROLLER_PORT_OFFSET for p in self.client_ports)

    @property
    def bootstrap(self) -> str:
        return ",".join(_hostport(self.host, p) for p in self.client_ports)


@dataclass(frozen=True)
class BrokerStatus:
    """What ``broker_status`` saw. ``running`` means every recorded process is alive (not "serving")."""

    running: bool
    bootstrap: str | None
    pids: tuple[int, ...]
    nodes: int  # as recorded at start; 0 when nothing is recorded
    data_dir: Path
    log_path: Path  # node 1's kafka.log; node i logs to data_dir/node-<i>/kafka.log


def ensure_kafka_jars(cache_dir: Path | None = None, *,
                      progress: Callable[[str], None] | None = None) -> Path:
    """Resolve the pinned Kafka jars with Maven once and return the directory holding them.

    Blocks: not at all when cached (a marker holds the pom's hash); else for the Maven run, up to
    15 minutes. Thread- and process-safe (a file lock). ``cache_dir`` defaults to
    ``$ROLLSTREAM_CACHE_DIR`` or ``~/.cache/rollstream``; jars land in ``<cache>/kafka-<version>/libs``.
    ``progress`` is called with one human sentence before a resolution starts.

    Raises:
        BrokerError: ``mvn`` or ``java`` is missing, or Maven failed (the tail of its output).
    """
    pom = _POM.read_bytes()
    found = re.search(rb"<kafka\.version>([^<]+)</kafka\.version>", pom)
    version = found.group(1).decode() if found else "unknown"
    env_cache = os.environ.get("ROLLSTREAM_CACHE_DIR")
    cache = Path(cache_dir or env_cache or Path.home() / ".cache" / "rollstream").expanduser()
    root = cache / f"kafka-{version}"
    libs, marker, digest = root / "libs", root / "complete", hashlib.sha256(pom).hexdigest()
    if _read_text(marker) == digest:
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven (`mvn`) is not on PATH; it resolves the Kafka jars once. Install it "
                          "(e.g. `apt-get install maven`) or point ROLLSTREAM_BOOTSTRAP_SERVERS at a cluster.")
    _java()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock", _MVN_TIMEOUT):
        if _read_text(marker) == digest:
            return libs
        message = f"resolving Apache Kafka {version} jars with Maven into {libs} (first run only)"
        log.info(message)
        if progress is not None:
            progress(message)
        shutil.rmtree(libs, ignore_errors=True)  # stale jars of another pom would shadow the new ones
        cmd = [mvn, "-B", "-q", "-f", str(_POM), "dependency:copy-dependencies", f"-DoutputDirectory={libs}"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_MVN_TIMEOUT,
                                  stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired as exc:
            raise BrokerError(f"`{' '.join(cmd)}` did not finish within {_MVN_TIMEOUT:.0f} s",
                              retriable=True) from exc
        if done.returncode != 0 or not any(libs.glob("kafka_2.13-*.jar")):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-_TAIL_LINES:])
            raise BrokerError(f"Maven could not resolve the Kafka jars (exit {done.returncode}): "
                              f"`{' '.join(cmd)}`\n{tail}")
        marker.write_text(digest)
    return libs


def start_broker(spec: BrokerSpec | None = None, *, timeout: float = 120.0) -> str:
    """Start the local broker described by ``spec`` (default ``BrokerSpec()``) and return its bootstrap.

    Blocks until a client can produce to and consume from the probe topic, at most ``timeout`` seconds
    (plus a one-time Maven resolution, see ``ensure_kafka_jars``); ~1.5 s for one node when warm.
    Idempotent: if a broker already runs for ``spec.data_dir`` with the same nodes and port, waits
    until it serves and returns its bootstrap. Process-safe (a lock file in ``data_dir``). The JVMs are
    detached (own session) and keep running after this process exits; ``stop_broker`` ends them.

    Raises:
        BrokerError: a port is held by another process; a broker with another spec runs for this
            data dir; the data dir holds a cluster with another node count; Java or Maven is missing;
            a node exited or the broker did not serve in time (message holds the tail of its log;
            everything started is killed first).
    """
    spec = spec if spec is not None else BrokerSpec()
    deadline = time.monotonic() + timeout
    spec.data_dir.mkdir(parents=True, exist_ok=True)
    with _locked(spec.data_dir / ".lock", timeout):
        if _adopt_running(spec, deadline):
            return spec.bootstrap
        libs, java = ensure_kafka_jars(), _java()
        _check_ports_free(spec)
        configs = [_write_config(spec, node) for node in range(1, spec.nodes + 1)]
        _format(java, libs, spec, configs, deadline)
        started = time.monotonic()
        procs: list[tuple[int, Path]] = []
        try:
            for config in configs:
                procs.append((_spawn(java, libs, spec, config), config))
            _write_json(spec.data_dir / "pids.json", {
                "bootstrap": spec.bootstrap, "port": spec.port, "nodes": spec.nodes, "host": spec.host,
                "pids": [pid for pid, _ in procs], "configs": [str(c) for _, c in procs]})
            _wait_ready(spec, procs, deadline, timeout)
        except BaseException:
            _terminate(procs, 5.0)
            (spec.data_dir / "pids.json").unlink(missing_ok=True)
            raise
    log.info("Kafka serves on %s (%d node(s), data dir %s) after %.1f s of JVM start",
             spec.bootstrap, spec.nodes, spec.data_dir, time.monotonic() - started)
    return spec.bootstrap


def stop_broker(data_dir: Path | None = None, *, timeout: float = 30.0) -> bool:
    """Stop the broker recorded in ``data_dir`` (default ``default_data_dir()``).

    Sends SIGTERM to each recorded pid that is still our Kafka JVM (its command line names
    ``kafka.Kafka`` and its ``server.properties`` in ``data_dir``), waits up to ``timeout`` seconds for
    a clean shutdown, then SIGKILLs what is left (and waits up to 5 s more). Removes ``pids.json``.
    Returns True if a process was signalled. Raises nothing for a broker that is already gone.
    """
    directory = Path(data_dir).expanduser().resolve() if data_dir else default_data_dir().resolve()
    record = _read_json(directory / "pids.json")
    if record is None:
        return False
    ours = [(pid, cfg) for pid, cfg in _recorded(record) if _is_ours(pid, cfg)]
    stopped = _terminate(ours, timeout)
    (directory / "pids.json").unlink(missing_ok=True)
    if stopped:
        log.info("stopped Kafka %s (pids %s, data dir %s)", record.get("bootstrap"),
                 [pid for pid, _ in ours], directory)
    return stopped


def broker_status(data_dir: Path | None = None) -> BrokerStatus:
    """Report whether the broker recorded in ``data_dir`` runs. Does not block; opens no connection.

    ``running`` is True when every recorded pid is still our Kafka JVM; it does not prove the broker
    serves (``start_broker`` waits for that). Raises nothing.
    """
    directory = Path(data_dir).expanduser().resolve() if data_dir else default_data_dir().resolve()
    log_path = directory / "node-1" / "kafka.log"
    record = _read_json(directory / "pids.json")
    if record is None:
        return BrokerStatus(False, None, (), 0, directory, log_path)
    recorded = _recorded(record)
    alive = tuple(pid for pid, cfg in recorded if _is_ours(pid, cfg))
    running = bool(alive) and len(alive) == len(recorded)
    return BrokerStatus(running, record.get("bootstrap") if running else None, alive,
                        int(record.get("nodes", len(recorded))), directory, log_path)


# --- processes -------------------------------------------------------------------------------------


def _adopt_running(spec: BrokerSpec, deadline: float) -> bool:
    """True if a broker for ``spec`` already runs and serves; clean up what is stale or partial."""
    record = _read_json(spec.data_dir / "pids.json")
    if record is None:
        return False
    recorded = _recorded(record)
    alive = [(pid, cfg) for pid, cfg in recorded if _is_ours(pid, cfg)]
    if alive and len(alive) == len(recorded):
        if (record.get("nodes"), record.get("port"), record.get("host")) != (spec.nodes, spec.port, spec.host):
            raise BrokerError(f"a {record.get('nodes')}-node broker already runs for {spec.data_dir} on "
                              f"{record.get('bootstrap')}; use it, or stop it first (stop_broker / "
                              f"`rollstream broker stop --data-dir {spec.data_dir}`)")
        _wait_ready(spec, alive, deadline, max(0.0, deadline - time.monotonic()))
        return True
    if alive:
        log.warning("only %d of %d Kafka nodes of %s still run; restarting all", len(alive),
                    len(recorded), spec.data_dir)
        _terminate(alive, 10.0)
    (spec.data_dir / "pids.json").unlink(missing_ok=True)
    return False


def _spawn(java: str, libs: Path, spec: BrokerSpec, config: Path) -> int:
    """Start one detached ``kafka.Kafka`` JVM and return its pid (not our child: no zombie to reap)."""
    node_dir = config.parent
    cmd = [java, f"-Xmx{spec.heap_mb}m", *_JVM_FLAGS, f"-Dlog4j2.configurationFile={_LOG4J}",
           f"-Dkafka.logs.dir={node_dir}", "-cp", f"{libs}/*", "kafka.Kafka", str(config)]
    # sh backgrounds java and exits; java is re-parented, so it outlives us and is reaped by init.
    script = 'out=$1; shift; "$@" </dev/null >>"$out" 2>&1 & echo $!'
    done = subprocess.run(["/bin/sh", "-c", script, "sh", str(node_dir / "stdout.log"), *cmd],
                          capture_output=True, text=True, timeout=30, start_new_session=True, check=False)
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        raise BrokerError(f"could not launch {java}: {done.stderr.strip() or done.stdout.strip()}")
    pid = int(done.stdout.strip())
    end = time.monotonic() + 5.0
    while not _is_ours(pid, config) and time.monotonic() < end:  # the fork has not exec'd java yet
        time.sleep(0.01)
    log.debug("started Kafka node %s as pid %d", node_dir.name, pid)
    return pid


def _terminate(procs: list[tuple[int, Path]], timeout: float) -> bool:
    """SIGTERM, wait up to ``timeout`` s, SIGKILL the rest; True if any signal was delivered."""
    signalled = False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        live = [(pid, cfg) for pid, cfg in procs if _is_ours(pid, cfg)]
        if not live:
            break
        if sig == signal.SIGKILL:
            log.warning("Kafka pids %s ignored SIGTERM for %.0f s; sending SIGKILL", [p for p, _ in live], timeout)
        for pid, _ in live:
            try:
                os.kill(pid, sig)
                signalled = True
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and any(_is_ours(pid, cfg) for pid, cfg in live):
            time.sleep(0.1)
    return signalled


def _is_ours(pid: int, config: Path) -> bool:
    """True while ``pid`` is a live ``kafka.Kafka`` JVM started on ``config`` (a zombie is not live)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask ps; a zombie shows as "<defunct>"
        done = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, check=False)
        argv = done.stdout.split()
    return b"kafka.Kafka" in argv and os.fsencode(str(config)) in argv


def _wait_ready(spec: BrokerSpec, procs: list[tuple[int, Path]], deadline: float, timeout: float) -> None:
    """Poll until the probe round-trip succeeds; raise if a node exits or the deadline passes."""
    last_error = "no answer yet"
    while True:
        dead = [cfg for pid, cfg in procs if not _is_ours(pid, cfg)]
        if dead:
            raise BrokerError(f"Kafka node {dead[0].parent.name} exited while starting on "
                              f"{spec.bootstrap}:\n{_log_tail(dead[0].parent)}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise BrokerError(f"Kafka did not serve on {spec.bootstrap} within {timeout:.0f} s (last probe "
                              f"error: {last_error}):\n{_log_tail(procs[0][1].parent)}", retriable=True)
        if _port_open(spec.host, spec.port):
            error = _probe(spec, min(left, 5.0))
            if error is None:
                return
            log.debug("%s not ready yet: %s", spec.bootstrap, error)
            last_error = error
        time.sleep(0.1)


# --- readiness probe -------------------------------------------------------------------------------


class _DebugLog:
    """librdkafka log sink: refused connections while the broker starts are expected, so DEBUG."""

    def log(self, level: int, msg: str, *args: Any) -> None:  # noqa: ARG002 - confluent's signature
        log.debug(msg, *args)


def _probe(spec: BrokerSpec, timeout: float) -> str | None:
    """One round trip (metadata, probe topic, acks=all produce, fetch, commit); None or the error."""
    timeout_ms = max(1000, int(timeout * 1000))
    common = {"bootstrap.servers": spec.bootstrap, "logger": _DebugLog(), "socket.timeout.ms": timeout_ms}
    try:
        admin = AdminClient(dict(common))
        brokers = admin.list_topics(timeout=timeout).brokers
        if len(brokers) < spec.nodes:
            return f"{len(brokers)} of {spec.nodes} brokers registered"
        if PROBE_TOPIC not in admin.list_topics(timeout=timeout).topics:
            topic = NewTopic(PROBE_TOPIC, 1, spec.nodes, config={
                "min.insync.replicas": str(min(spec.nodes, 2)), "retention.ms": "3600000"})
            try:
                admin.create_topics([topic], operation_timeout=timeout)[PROBE_TOPIC].result(timeout)
            except KafkaException as exc:
                if "already exists" not in str(exc):
                    raise
        offsets: list[int] = []
        producer = Producer({**common, "acks": "all", "message.timeout.ms": timeout_ms})
        producer.produce(PROBE_TOPIC, b"probe",
                         on_delivery=lambda err, msg: offsets.append(-1 if err else msg.offset()))
        producer.flush(timeout)
        if not offsets or offsets[0] < 0:
            return "probe record not acknowledged"
        return _probe_consume(common, offsets[0], timeout)
    except KafkaException as exc:
        return str(exc.args[0] if exc.args else exc)


def _probe_consume(common: dict[str, Any], offset: int, timeout: float) -> str | None:
    consumer = Consumer({**common, "group.id": PROBE_TOPIC, "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(PROBE_TOPIC, 0, offset)])
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            msg = consumer.poll(0.2)
            if msg is not None and not msg.error():
                # A synchronous commit brings up the group coordinator (__consumer_offsets) now.
                consumer.commit(offsets=[TopicPartition(PROBE_TOPIC, 0, offset + 1)], asynchronous=False)
                return None
        return "probe record not fetched"
    finally:
        consumer.close()


# --- files, ports and configuration ----------------------------------------------------------------


def _write_config(spec: BrokerSpec, node: int) -> Path:
    """Write ``node-<node>/server.properties`` (each start, so a new port applies) and return it."""
    node_dir = spec.data_dir / f"node-{node}"
    (node_dir / "data").mkdir(parents=True, exist_ok=True)
    client, controller = spec.client_ports[node - 1], spec.controller_ports[node - 1]
    rf, min_isr = spec.nodes, min(spec.nodes, 2)
    voters = ",".join(f"{i + 1}@{_hostport(spec.host, p)}" for i, p in enumerate(spec.controller_ports))
    props = {
        "process.roles": "broker,controller", "node.id": node, "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{_hostport(spec.host, client)},CONTROLLER://{_hostport(spec.host, controller)}",
        "advertised.listeners": f"PLAINTEXT://{_hostport(spec.host, client)}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT", "controller.listener.names": "CONTROLLER",
        "log.dirs": node_dir / "data", "num.partitions": 1, "auto.create.topics.enable": "false",
        "default.replication.factor": rf, "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": rf, "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr, "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": min_isr, "group.initial.rebalance.delay.ms": 0,
        "message.max.bytes": _MAX_MESSAGE_BYTES, "replica.fetch.max.bytes": _MAX_MESSAGE_BYTES,
        "replica.fetch.response.max.bytes": _MAX_MESSAGE_BYTES,
        # Tests use session.timeout.ms=6000 (classic protocol); the consumer protocol gets 10 s.
        "group.min.session.timeout.ms": 1000, "group.consumer.min.session.timeout.ms": 1000,
        "group.consumer.session.timeout.ms": 10000, "group.consumer.min.heartbeat.interval.ms": 500,
        "group.consumer.heartbeat.interval.ms": 2000,
    }
    config = node_dir / "server.properties"
    config.write_text("# Written by infra/broker.py at each start; edits are overwritten.\n"
                      + "".join(f"{key}={value}\n" for key, value in props.items()))
    return config


def _format(java: str, libs: Path, spec: BrokerSpec, configs: list[Path], deadline: float) -> None:
    """Format the storage of every node not formatted yet, all with one cluster id (kept in cluster.json)."""
    meta_path = spec.data_dir / "cluster.json"
    meta = _read_json(meta_path)
    if meta is None:
        cluster_id = "-"
        while cluster_id.startswith("-"):  # as Kafka's Uuid.randomUuid: a leading "-" reads as a CLI flag
            cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        meta = {"cluster_id": cluster_id, "nodes": spec.nodes}
        _write_json(meta_path, meta)
    elif meta.get("nodes") != spec.nodes:
        raise BrokerError(f"{spec.data_dir} holds a {meta.get('nodes')}-node cluster; start it with "
                          f"nodes={meta.get('nodes')} or use another data dir")
    todo = [c for c in configs if not (c.parent / "data" / "meta.properties").exists()]
    runs = [(c, subprocess.Popen(
        [java, "-Xmx256m", *_JVM_FLAGS, f"-Dlog4j2.configurationFile={_LOG4J}",
         f"-Dkafka.logs.dir={c.parent}", "-cp", f"{libs}/*", "kafka.tools.StorageTool", "format",
         f"--cluster-id={meta['cluster_id']}", "-c", str(c)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for c in todo]
    for config, proc in runs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as exc:
            for _, other in runs:
                other.kill()
                other.wait()
            raise BrokerError(f"formatting {config.parent} timed out", retriable=True) from exc
        if proc.returncode != 0:
            raise BrokerError(f"formatting {config.parent} failed (exit {proc.returncode}):\n"
                              + "\n".join(output.splitlines()[-_TAIL_LINES:]))
        log.info("formatted %s for cluster %s", config.parent, meta["cluster_id"])


def _check_ports_free(spec: BrokerSpec) -> None:
    for port in (*spec.client_ports, *spec.controller_ports):
        family = socket.AF_INET6 if ":" in spec.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR as Kafka sets it: TIME_WAIT leftovers of our last run do not count, listeners do.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((spec.host, port))
            except OSError as exc:
                role = "client" if port in spec.client_ports else "controller"
                raise BrokerError(
                    f"{role} port {port} on {spec.host} is already in use ({exc.strerror}). Choose another "
                    f"base port (BrokerSpec(port=...) / `rollstream broker start --port`; node i uses "
                    f"port+i-1 and port+{CONTROLLER_PORT_OFFSET}+i-1) or stop what listens there.") from exc


def _port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _log_tail(node_dir: Path) -> str:
    """The JVM's own output, the first ERROR of the latest run (the cause), then the last lines."""
    parts = []
    for name, count in (("stdout.log", 10), ("kafka.log", _TAIL_LINES)):
        lines = (_read_text(node_dir / name) or "").splitlines()
        # Logs append across runs: the last "Log4jController" line opens the latest JVM's output.
        run = max((i for i, line in enumerate(lines) if "kafka.Log4jController" in line), default=0)
        first_error = next((i for i in range(run, len(lines)) if re.search(r"\] (ERROR|FATAL) ", lines[i])), None)
        keep = lines[-count:]
        if first_error is not None and first_error < len(lines) - count:
            keep = [*lines[first_error:first_error + 4], "[...]", *lines[-(count - 5):]]
        if keep:
            parts.append(f"--- {node_dir / name} ---\n" + "\n".join(keep))
    return "\n".join(parts) or f"(no log in {node_dir})"


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").exists() else shutil.which("java")
    if java is None:
        raise BrokerError("Java (17 or newer) is not on PATH and JAVA_HOME is unset; the local Kafka broker "
                          "needs it (e.g. `apt-get install openjdk-17-jre-headless`).")
    return java


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _recorded(record: dict[str, Any]) -> list[tuple[int, Path]]:
    return [(int(pid), Path(cfg)) for pid, cfg in zip(record.get("pids", []), record.get("configs", []), strict=False)]


def _read_json(path: Path) -> dict[str, Any] | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        log.warning("ignoring unreadable %s", path)
        return None
    return value if isinstance(value, dict) else None


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new record


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")  # logs roll at 10 MiB, so reading one whole is fine
    except OSError:
        return None


@contextmanager
def _locked(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path``; BrokerError after ``timeout`` seconds of waiting."""
    deadline = time.monotonic() + timeout
    with open(path, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BrokerError(f"{path} stayed locked by another rollstream process for "
                                      f"{timeout:.0f} s", retriable=True) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
