"""The local broker's value types and its one error. Import them from ``rollstream.infra.broker``, which
re-exports them.

``BrokerSpec`` validates itself (each bad value is named); ``BrokerStatus`` is what ``broker_status`` saw.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollstream.schemas import ConfigError, RollstreamError

CONTROLLER_PORT_OFFSET = 100
PROBE_TOPIC = "__rollstream_probe"
KAFKA_VERSION_ENV = "ROLLSTREAM_KAFKA_VERSION"
POM = Path(__file__).resolve().parent.parent / "kafka" / "pom.xml"
# KRaft is production-ready from 3.3, and 4.x brokers upgrade from 3.3 on; older lines run KRaft only as a preview.
OLDEST_KAFKA = (3, 3)
# SCRAM users in KRaft mode (StorageTool format --add-scram, KIP-900) came in 3.5.
SASL_KAFKA = (3, 5)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


def pinned_kafka_version() -> str:
    """The Kafka version pinned in ``infra/kafka/pom.xml`` (``<kafka.version>``), the one tests and docs name.

    Raises:
        BrokerError: the pom is unreadable or pins no version.
    """
    try:
        found = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    except OSError as exc:
        raise BrokerError(f"cannot read {POM} ({exc}): reinstall rollstream; it pins the local broker's Kafka") from exc
    if found is None:
        raise BrokerError(f"{POM} has no <kafka.version>: restore it from rollstream's sources")
    return found.group(1).strip()


def default_kafka_version() -> str:
    """``$ROLLSTREAM_KAFKA_VERSION`` if set (another Apache Kafka release on Maven Central), else the pinned one."""
    return os.environ.get(KAFKA_VERSION_ENV, "").strip() or pinned_kafka_version()


def kafka_release(version: str) -> tuple[int, int, int]:
    """``"3.3.2"`` -> ``(3, 3, 2)``.

    Raises:
        ConfigError: ``version`` is not ``MAJOR.MINOR.PATCH``.
    """
    found = _VERSION.fullmatch(version) if isinstance(version, str) else None
    if found is None:
        raise ConfigError(f"Kafka version {version!r} (--kafka-version, ${KAFKA_VERSION_ENV}): must be an Apache "
                          "Kafka release such as 4.4.0 or 3.3.2")
    return int(found.group(1)), int(found.group(2)), int(found.group(3))


def default_data_dir() -> Path:
    """``$ROLLSTREAM_HOME/broker`` if ``ROLLSTREAM_HOME`` is set, else ``~/.rollstream/broker``."""
    home = os.environ.get("ROLLSTREAM_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".rollstream") / "broker"


class BrokerError(RollstreamError):
    """The local broker cannot be resolved, started, reached or stopped; the message says why."""


@dataclass(frozen=True)
class BrokerSpec:
    """What to start. ``nodes=3`` gives three combined KRaft nodes (rf 3, min.insync.replicas 2).

    ``sasl=True`` starts it secured: SASL/SCRAM-SHA-512 for clients, the StandardAuthorizer, SCRAM users
    admin (super user), producer and trainer, and a client config file per user (see ``rollstream.infra.broker._sasl``).
    ``tls=True`` encrypts every listener with certificates of a local CA (``SASL_SSL`` with ``sasl``, else ``SSL``);
    ``mtls=True`` (needs ``tls``) also requires a client certificate, whose CN is the principal
    (see ``rollstream.infra.broker._tls``). Either writes the client config files too.

    Node ``i`` (1-based) serves clients on ``port + i - 1`` and runs its KRaft controller on
    ``controller_port + i - 1``; ``controller_port=None`` means ``port + CONTROLLER_PORT_OFFSET``.

    ``kafka_version`` is the Apache Kafka release to run (resolved by Maven into a jar dir of its own): by default
    ``$ROLLSTREAM_KAFKA_VERSION``, else the one pinned in ``infra/kafka/pom.xml``; 3.3.0 or newer (KRaft), and
    3.5.0 or newer with ``sasl``.
    """

    port: int = 9092
    nodes: Literal[1, 3] = 1
    data_dir: Path = field(default_factory=default_data_dir)
    heap_mb: int = 512
    host: str = "127.0.0.1"
    controller_port: int | None = None
    sasl: bool = False
    tls: bool = False
    mtls: bool = False
    kafka_version: str = field(default_factory=default_kafka_version)

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or self.nodes not in (1, 3):
            raise ConfigError(f"BrokerSpec.nodes={self.nodes!r}: must be 1 or 3")
        self._check_ports()
        for name in ("sasl", "tls", "mtls"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"BrokerSpec.{name}={getattr(self, name)!r}: must be True or False")
        if self.mtls and not self.tls:
            raise ConfigError("BrokerSpec.mtls=True needs tls=True: client certificates are a part of TLS")
        if isinstance(self.heap_mb, bool) or not isinstance(self.heap_mb, int) or self.heap_mb < 128:
            raise ConfigError(f"BrokerSpec.heap_mb={self.heap_mb!r}: must be an int >= 128")
        try:
            unspecified = ipaddress.ip_address(self.host).is_unspecified
        except ValueError:
            unspecified = True
        if unspecified:
            raise ConfigError(f"BrokerSpec.host={self.host!r}: must be one IP address such as 127.0.0.1")
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser().resolve())
        self._check_kafka_version()

    def _check_kafka_version(self) -> None:
        release = kafka_release(self.kafka_version)
        if release[:2] < OLDEST_KAFKA:
            raise ConfigError(f"BrokerSpec.kafka_version={self.kafka_version!r} (--kafka-version, ${KAFKA_VERSION_ENV})"
                              f": the local broker runs in KRaft mode, production-ready from "
                              f"{'.'.join(map(str, OLDEST_KAFKA))}.0; choose that or newer")
        if self.sasl and release[:2] < SASL_KAFKA:
            raise ConfigError(f"BrokerSpec.sasl=True needs Kafka {'.'.join(map(str, SASL_KAFKA))}.0 or newer (SCRAM "
                              f"users in KRaft mode, KIP-900), not kafka_version={self.kafka_version!r}; choose a "
                              "newer --kafka-version or leave out --sasl")

    @property
    def kafka_release(self) -> tuple[int, int, int]:
        return kafka_release(self.kafka_version)

    def _check_ports(self) -> None:
        last = self.nodes - 1
        if not _is_port(self.port) or self.port + last > 65535:
            raise ConfigError(f"BrokerSpec.port={self.port!r} (--port): must be an int with port+{last} <= 65535")
        if self.controller_port is None:
            if self.port + CONTROLLER_PORT_OFFSET + last > 65535:
                raise ConfigError(
                    f"BrokerSpec.port={self.port!r} (--port): the controller ports default to port+"
                    f"{CONTROLLER_PORT_OFFSET}, so port+{CONTROLLER_PORT_OFFSET + last} must be <= 65535; "
                    "choose a lower port or set controller_port (--controller-port)")
            return
        if not _is_port(self.controller_port) or self.controller_port + last > 65535:
            raise ConfigError(f"BrokerSpec.controller_port={self.controller_port!r} (--controller-port): must be "
                              f"an int with controller_port+{last} <= 65535")
        if set(self.controller_ports) & set(self.client_ports):
            raise ConfigError(
                f"BrokerSpec.controller_port={self.controller_port} (--controller-port): controller ports "
                f"{_span(self.controller_ports)} overlap the client ports {_span(self.client_ports)}; choose "
                "a controller port outside them")

    @property
    def client_ports(self) -> tuple[int, ...]:
        return tuple(self.port + i for i in range(self.nodes))

    @property
    def controller_ports(self) -> tuple[int, ...]:
        first = self.port + CONTROLLER_PORT_OFFSET if self.controller_port is None else self.controller_port
        return tuple(first + i for i in range(self.nodes))

    @property
    def bootstrap(self) -> str:
        return ",".join(hostport(self.host, p) for p in self.client_ports)


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535


def _span(ports: tuple[int, ...]) -> str:
    return str(ports[0]) if len(ports) == 1 else f"{ports[0]}-{ports[-1]}"


@dataclass(frozen=True)
class BrokerStatus:
    """What ``broker_status`` saw. ``running`` means every recorded process is alive (not "serving")."""

    running: bool
    bootstrap: str | None
    pids: tuple[int, ...]
    nodes: int  # as recorded at start; 0 when nothing is recorded
    data_dir: Path
    log_path: Path  # node 1's kafka.log; node i logs to data_dir/node-<i>/kafka.log
    controller_ports: tuple[int, ...] = ()  # as recorded at start; () when nothing is recorded
    sasl: bool = False  # as recorded at start: SASL/SCRAM and ACLs (client configs in data_dir/<user>.properties)
    node_pids: tuple[int | None, ...] = ()  # node i's JVM at index i - 1; None where that node does not run
    tls: bool = False  # as recorded at start: every listener TLS (the CA is data_dir/tls/ca.pem)
    mtls: bool = False  # as recorded at start: client certificates required, their CN the principal
    kafka_version: str | None = None  # as recorded at start; None when nothing is recorded


def hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
