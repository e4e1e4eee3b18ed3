"""Is the local broker there yet: ports free before a start, and the readiness probe after it.

Ready means one client round trip works end to end: every node is registered, the probe topic
``__rollstream_probe`` exists, a record is produced with acks=all, fetched back, and its offset committed
(so the group coordinator is up too). One probe outlives its timeout by about a second at most, even
when the coordinator never comes up.
"""

from __future__ import annotations

import logging
import random
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from rollstream.infra.broker._files import log_tail
from rollstream.infra.broker._procs import is_ours
from rollstream.infra.broker._spec import CONTROLLER_PORT_OFFSET, PROBE_TOPIC, BrokerError, BrokerSpec, hostport
from rollstream.infra.broker._tls import client_settings

log = logging.getLogger(__name__)

_PROBE_TIMEOUT = 5.0  # per round trip; a slow one is retried until the caller's deadline


def free_port(nodes: int = 1, host: str = "127.0.0.1") -> int:
    """A base port whose client ports (port + i) and default controller ports (port + CONTROLLER_PORT_OFFSET + i),
    i < `nodes`, are all free on `host` right now (another process may still take them before a start).

    Raises:
        BrokerError: no such range found in 200 tries.
    """
    for _ in range(200):
        base = _os_port(host)
        ports = [base + i for i in range(nodes)] + [base + CONTROLLER_PORT_OFFSET + i for i in range(nodes)]
        if _all_free(host, ports):
            return base
    raise BrokerError(f"no free range of broker ports for {nodes} node(s) on {host}")


def free_ports(nodes: int = 1, host: str = "127.0.0.1") -> tuple[int, int]:
    """``(port, controller_port)`` for ``BrokerSpec``: client ports port + i and controller ports
    controller_port + i, i < `nodes`, all distinct and free on `host` right now (another process may
    still take them before a start). Unlike ``free_port``, the controllers are not at port + 100.

    Raises:
        BrokerError: no such pair of ranges found in 200 tries.
    """
    for _ in range(200):
        port, controller = _os_port(host), _os_port(host)
        ports = [port + i for i in range(nodes)] + [controller + i for i in range(nodes)]
        if len(set(ports)) == len(ports) and _all_free(host, ports):
            return port, controller
    raise BrokerError(f"no two free ranges of broker ports for {nodes} node(s) on {host}")


_LOWEST_PORT = 10_000
_RANGE_WIDTH = CONTROLLER_PORT_OFFSET + 16  # room above a base for the client and controller ports of a cluster


def _os_port(host: str) -> int:
    """A candidate base port on `host` (checked free by the caller), below the OS's ephemeral range: while a node is
    down its clients reconnect to its port over and over, and a connect whose ephemeral source port is that very
    port connects to itself (TCP simultaneous open) and holds it, so the restarted node cannot bind it ("Address
    already in use": seen in `make chaos NODES=3` and the fleet's churn run)."""
    top = _first_ephemeral_port() - _RANGE_WIDTH
    return random.randrange(_LOWEST_PORT, top) if top > _LOWEST_PORT else _bound_port(host)


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere (no /proc) the OS's choice is the fallback below 10,000


def _bound_port(host: str) -> int:
    """A port the OS calls free on `host` now (in its ephemeral range)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _all_free(host: str, ports: list[int]) -> bool:
    return max(ports) <= 65535 and all(_bind_error(host, p) is None for p in ports)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bind_error(host: str, port: int) -> OSError | None:
    """None if a listener could bind `port` on `host` now, else the error that bind gave."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as Kafka sets it: TIME_WAIT leftovers of our last run do not count, listeners do.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return None
        except OSError as exc:
            return exc


def check_ports_free(spec: BrokerSpec) -> None:
    """Raise BrokerError naming the first client or controller port of ``spec`` that is taken, and the flag
    (and ``BrokerSpec`` field) that moves it."""
    for role, ports in (("client", spec.client_ports), ("controller", spec.controller_ports)):
        for port in ports:
            exc = _bind_error(spec.host, port)
            if exc is None:
                continue
            if role == "client":
                fix = ("choose another --port (BrokerSpec(port=...)); node i serves clients on port+i-1, and its "
                       f"controller on port+{CONTROLLER_PORT_OFFSET}+i-1 unless --controller-port is given")
            else:
                fix = ("choose another --controller-port (BrokerSpec(controller_port=...)); node i's controller "
                       f"listens on controller_port+i-1, by default port+{CONTROLLER_PORT_OFFSET}+i-1")
            raise BrokerError(f"{role} port {port} on {spec.host} is already in use ({exc.strerror}): {fix}; "
                              "or stop what listens there")


def wait_ready(spec: BrokerSpec, procs: Sequence[tuple[int, Path]], deadline: float, timeout: float) -> None:
    """Poll until the probe round trip succeeds, at most until ``deadline`` (``time.monotonic()``).

    ``timeout`` is only named in the error. Leaves ``procs`` running whatever happens.

    Raises:
        BrokerError: a node of ``procs`` exited, or the deadline passed (retriable); with the log tail.
    """
    last_error = "no answer yet"
    while True:
        dead = [cfg for pid, cfg in procs if not is_ours(pid, cfg)]
        if dead:
            tail = log_tail(dead[0].parent)
            taken = (" (a port was taken after the check: choose another --port or --controller-port)"
                     if "Address already in use" in tail else "")
            raise BrokerError(f"Kafka node {dead[0].parent.name} exited while starting on {spec.bootstrap}{taken}; "
                              f"its log below says why; fix that and start again:\n{tail}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise BrokerError(
                f"Kafka did not serve on {spec.bootstrap} within the {timeout:.0f} s timeout (last probe error: "
                f"{last_error}). If the log below shows it still starting, start again with a longer timeout "
                f"(start_broker(timeout=...) / `rollstream broker start --timeout`):\n{log_tail(procs[0][1].parent)}",
                retriable=True)
        if _port_open(spec.host, spec.port):
            error = _probe(spec, min(left, _PROBE_TIMEOUT))
            if error is None:
                return
            log.debug("%s not ready yet: %s", spec.bootstrap, error)
            last_error = error
        time.sleep(0.1)


def wait_node_serves(node: int, proc: tuple[int, Path], host: str, port: int, auth: dict[str, Any],
                     deadline: float, timeout: float) -> None:
    """Poll until node ``node`` (``proc``: its pid and config) answers a metadata request sent to it alone
    (``host:port``, with the librdkafka settings ``auth``) and lists itself as a registered broker, at most until
    ``deadline``. ``timeout`` is only named in the error. Leaves the node running whatever happens.

    Raises:
        BrokerError: the node exited, or the deadline passed (retriable); with its log tail.
    """
    pid, config = proc
    bootstrap, last_error = hostport(host, port), "no answer yet"
    while True:
        if not is_ours(pid, config):
            raise BrokerError(f"Kafka node {node} exited right after its restart; its log below says why; fix that "
                              f"and restart it again:\n{log_tail(config.parent)}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise BrokerError(f"Kafka node {node} did not serve on {bootstrap} within {timeout:.0f} s (last probe "
                              f"error: {last_error}). If the log below shows it still starting, restart it with a "
                              f"longer timeout:\n{log_tail(config.parent)}", retriable=True)
        if _port_open(host, port):
            error = _node_answers(node, bootstrap, auth, min(left, _PROBE_TIMEOUT))
            if error is None:
                return
            log.debug("node %d on %s not serving yet: %s", node, bootstrap, error)
            last_error = error
        time.sleep(0.1)


def _node_answers(node: int, bootstrap: str, auth: dict[str, Any], timeout: float) -> str | None:
    """None when the node at ``bootstrap`` answers metadata and lists itself, else what went wrong."""
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _DebugLog(),
                            "socket.timeout.ms": max(1000, int(timeout * 1000)), **auth}
    admin = AdminClient(conf)
    try:
        metadata = admin.list_topics(timeout=max(0.1, timeout))
    except KafkaException as exc:
        return str(exc.args[0] if exc.args else exc)
    return None if node in metadata.brokers else f"node {node} not among the registered brokers yet"


def _port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


class _DebugLog:
    """librdkafka log sink: refused connections while the broker starts are expected, so DEBUG."""

    def log(self, level: int, msg: str, *args: Any) -> None:  # noqa: ARG002 - confluent's signature
        log.debug(msg, *args)


def _probe(spec: BrokerSpec, timeout: float) -> str | None:
    """One round trip (metadata, probe topic, acks=all produce, fetch, commit); None or the error."""
    end = time.monotonic() + timeout
    timeout_ms = max(1000, int(timeout * 1000))
    common: dict[str, Any] = {"bootstrap.servers": spec.bootstrap, "logger": _DebugLog(),
                              "socket.timeout.ms": timeout_ms}
    # The probe runs as the super user.
    common.update(client_settings(spec.data_dir, "admin", sasl=spec.sasl, tls=spec.tls, mtls=spec.mtls))
    try:
        admin = AdminClient(dict(common))
        metadata = admin.list_topics(timeout=_left(end))
        if len(metadata.brokers) < spec.nodes:
            return f"{len(metadata.brokers)} of {spec.nodes} brokers registered"
        if PROBE_TOPIC not in metadata.topics:
            topic = NewTopic(PROBE_TOPIC, 1, spec.nodes, config={
                "min.insync.replicas": str(min(spec.nodes, 2)), "retention.ms": "3600000"})
            try:
                admin.create_topics([topic], operation_timeout=_left(end))[PROBE_TOPIC].result(_left(end))
            except KafkaException as exc:
                if "already exists" not in str(exc):
                    raise
        offsets: list[int] = []

        def delivered(err: object, msg: Any) -> None:
            offset = msg.offset()
            offsets.append(-1 if err or offset is None else offset)

        producer = Producer({**common, "acks": "all", "message.timeout.ms": timeout_ms})
        producer.produce(PROBE_TOPIC, b"probe", on_delivery=delivered)
        producer.flush(_left(end))
        if not offsets or offsets[0] < 0:
            return "probe record not acknowledged"
        return _probe_consume(common, offsets[0], end)
    except KafkaException as exc:
        return str(exc.args[0] if exc.args else exc)


def _probe_consume(common: dict[str, Any], offset: int, end: float) -> str | None:
    # A synchronous commit waits for the group coordinator up to session.timeout.ms (45 s by default), and
    # so does close() with a commit pending; both are capped here at what is left of the probe's timeout.
    left_ms = max(1000, int(_left(end) * 1000))
    consumer = Consumer({**common, "group.id": PROBE_TOPIC, "enable.auto.commit": False,
                         "socket.timeout.ms": left_ms, "session.timeout.ms": left_ms})
    try:
        consumer.assign([TopicPartition(PROBE_TOPIC, 0, offset)])
        while time.monotonic() < end:
            msg = consumer.poll(min(0.2, _left(end)))
            if msg is not None and not msg.error():
                # A synchronous commit brings up the group coordinator (__consumer_offsets) now.
                consumer.commit(offsets=[TopicPartition(PROBE_TOPIC, 0, offset + 1)], asynchronous=False)
                return None
        return "probe record not fetched"
    finally:
        consumer.close()


def _left(end: float) -> float:
    """Seconds until ``end``, at least 0.1 (librdkafka treats 0 as "do not wait at all")."""
    return max(0.1, end - time.monotonic())
