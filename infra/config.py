"""One place that builds every confluent-kafka client configuration in rollstream.

Every producer, consumer and admin client is configured from a `KafkaConfig`: the bootstrap address
(``ROLLSTREAM_BOOTSTRAP_SERVERS`` or ``--bootstrap-servers``), any librdkafka property from a
``--kafka-config FILE`` (security.protocol, sasl.*, ssl.*, tuning), and size limits derived from the
same number as the topic plan's ``max.message.bytes`` so that producer, consumer and topic cannot
disagree. Settings that carry a rollstream guarantee (idempotence, acks=all, manual commits) cannot be
overridden from the file; trying is a `ConfigError` naming the key.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rollstream.schemas import ConfigError

BOOTSTRAP_ENV = "ROLLSTREAM_BOOTSTRAP_SERVERS"
DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
# The trainer's consumer group when none is given (the trainer, `rollstream take`, and producers' lag gate).
DEFAULT_TRAINER_GROUP = "rollstream-trainer"
LIBRDKAFKA_LOGGER = logging.getLogger("librdkafka")  # where every client's librdkafka log lines go
# The Python level confluent-kafka logs each librdkafka (syslog) level at: 0 emerg, 1 alert, 2 crit, 3 err,
# 4 warning, 5 notice, 6 info, 7 debug.
_PYTHON_LEVEL_OF_SYSLOG = (logging.CRITICAL,) * 3 + (logging.ERROR, logging.WARNING, logging.INFO, logging.INFO,
                                                     logging.DEBUG)
MiB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
_FETCH_CHUNK_BYTES = 16 * MiB  # per fetch response; a larger record still comes whole
# Protocol framing on top of a record: librdkafka wants receive.message.max.bytes >= fetch.max.bytes + 512.
_FRAMING_BYTES = 64 * 1024

_PRODUCER_GUARANTEES = {"enable.idempotence": True, "acks": "all"}
# earliest: a group that has committed nothing starts at the first record (latest would skip every prompt
# or group already there, and a producer would then exit "idle" having done nothing).
_CONSUMER_GUARANTEES = {"enable.auto.commit": False, "enable.auto.offset.store": False,
                        "auto.offset.reset": "earliest"}
# Set per client by rollstream, never by a shared config file: each names what to use instead.
_PER_CLIENT = {
    "group.id": "the trainer's group is --group (RolloutConsumer(group_id=...)) and the producers' is "
                "NS.producers (ProducerSettings.intake_group); one file serves every client, and a group id in "
                "it would make trainers, audits and producers read as one group. Remove it",
    "group.instance.id": "a producer's static identity is --producer-id (ProducerSettings.producer_id). Remove it",
}


def default_bootstrap() -> str:
    """The bootstrap address from ``ROLLSTREAM_BOOTSTRAP_SERVERS``, else ``127.0.0.1:9092``."""
    return os.environ.get(BOOTSTRAP_ENV) or DEFAULT_BOOTSTRAP


def librdkafka_log_level(logger: logging.Logger = LIBRDKAFKA_LOGGER) -> int:
    """librdkafka's ``log_level`` (syslog, 0-7) for `logger` as it is now: the most detailed level whose lines it
    would emit, so that librdkafka hands over no line it would drop; 0 (emergencies only) when it emits none.

    Why: every line handed over is a Python call made from inside a blocking ``consume()`` or ``flush()``, and a
    KeyboardInterrupt that arrives during it is lost by confluent-kafka 2.16 (the call raises ``SystemError:
    ... returned NULL without setting an exception``). The logger is still passed at level 0, so that no line
    goes to stderr past it. A ``debug`` property makes librdkafka log at 7 whatever this says.
    """
    wanted = [syslog for syslog, level in enumerate(_PYTHON_LEVEL_OF_SYSLOG) if logger.isEnabledFor(level)]
    return max(wanted, default=0)


def read_properties(path: Path) -> dict[str, str]:
    """Parse a Java-style properties file (``key=value`` or ``key: value``; ``#``/``!`` comments).

    Raises:
        ConfigError: the file is missing or a line has no ``=``; the message names file and line.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read Kafka config file {path}: {exc.strerror}") from exc
    props: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        sep = min((i for i in (line.find("="), line.find(":")) if i > 0), default=-1)
        if sep < 0:
            raise ConfigError(f"{path}:{lineno}: expected 'key=value', got {raw!r}")
        props[line[:sep].strip()] = line[sep + 1:].strip()
    return props


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach Kafka and the size limits every client derives from.

    Attributes:
        bootstrap_servers: comma-separated host:port list.
        extra: any librdkafka properties (copied); applied to every client, below the guarantees.
        max_message_bytes: the largest record (a whole ScoredGroup), the same as the topics'.
        client_id: prefix of each client's ``client.id`` (shows up in broker logs and metrics).
    """

    bootstrap_servers: str = field(default_factory=default_bootstrap)
    extra: Mapping[str, Any] = field(default_factory=dict)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    client_id: str = "rollstream"

    def __post_init__(self) -> None:
        if not self.bootstrap_servers or not isinstance(self.bootstrap_servers, str):
            raise ConfigError(f"bootstrap_servers must be 'host:port[,host:port]', got {self.bootstrap_servers!r}; "
                              f"set {BOOTSTRAP_ENV} or pass --bootstrap-servers")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes={self.max_message_bytes} is too small (at least 1024)")
        object.__setattr__(self, "extra", dict(self.extra))
        if "bootstrap.servers" in self.extra:
            raise ConfigError("set the bootstrap address with --bootstrap-servers or "
                              f"{BOOTSTRAP_ENV}, not bootstrap.servers in the Kafka config file")
        for key, instead in _PER_CLIENT.items():
            if key in self.extra:
                raise ConfigError(f"{key}={self.extra[key]!r} cannot be set in the Kafka config: {instead}")

    @classmethod
    def load(cls, bootstrap_servers: str | None = None, kafka_config_file: Path | None = None,
             **kwargs: Any) -> KafkaConfig:
        """Build from CLI-style inputs: an optional bootstrap address and an optional properties file."""
        extra = read_properties(kafka_config_file) if kafka_config_file else {}
        return cls(bootstrap_servers=bootstrap_servers or default_bootstrap(), extra=extra, **kwargs)

    def with_client_id(self, client_id: str) -> KafkaConfig:
        return replace(self, client_id=client_id)

    def common(self) -> dict[str, Any]:
        """Settings shared by every client: bootstrap, client id, and the user's extra properties.

        librdkafka's own log lines go to the Python logger ``librdkafka`` (not straight to stderr), so an
        application decides what it shows: against an unreachable broker librdkafka logs every failed
        connection, hundreds of lines, while rollstream raises one `KafkaIOError` that says it all. Only the
        levels that logger emits when the client is created are handed over (``log_level``, see
        `librdkafka_log_level`): each line handed over runs Python code inside ``consume()``/``flush()``, where
        confluent-kafka 2.16 turns a Ctrl-C into a ``SystemError``."""
        # Idle connections closed by the broker are normal; librdkafka logs each one otherwise.
        return {"bootstrap.servers": self.bootstrap_servers, "client.id": self.client_id,
                "log.connection.close": False, "log_level": librdkafka_log_level(), "logger": LIBRDKAFKA_LOGGER,
                **self.extra}

    def producer(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """An idempotent, acks=all producer config sized for `max_message_bytes`."""
        conf = {
            "linger.ms": 5,
            "compression.type": "lz4",
            "message.max.bytes": self.max_message_bytes + _FRAMING_BYTES,
            "queue.buffering.max.kbytes": max(1024 * 1024, 2 * self.max_message_bytes // 1024),
            **self.common(),
            **(overrides or {}),
        }
        return _with_guarantees(conf, _PRODUCER_GUARANTEES)

    def manifest_producer(self) -> dict[str, Any]:
        """A producer config for step manifests: acks=all and one request in flight (records stay in
        order), not idempotent. Idempotence buys nothing there (a manifest written twice is superseded
        by itself) and costs the first commit up to 500 ms: librdkafka asks for a producer id only
        every 500 ms until a broker connection is up."""
        conf = {"linger.ms": 0, "message.max.bytes": self.max_message_bytes + _FRAMING_BYTES, **self.common()}
        conf.update({"enable.idempotence": False, "acks": "all", "max.in.flight.requests.per.connection": 1})
        return conf

    def consumer(self, group_id: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A manually committing consumer config for `group_id`, able to fetch a `max_message_bytes` record."""
        fetch_max = self.max_message_bytes + _FRAMING_BYTES
        # Fetch in moderate chunks: the broker still returns a larger record whole when it comes first
        # (KIP-74), and receive.message.max.bytes admits it. A fetch sized for the largest record instead
        # makes librdkafka allocate (and page-fault) tens of MiB per response: twice the system CPU.
        chunk = min(fetch_max, _FETCH_CHUNK_BYTES)
        conf = {
            "group.id": group_id,
            "auto.offset.reset": "earliest",
            "max.partition.fetch.bytes": chunk // 4,
            "fetch.max.bytes": chunk,
            "message.max.bytes": chunk,  # a consumer produces nothing; librdkafka wants it <= fetch.max.bytes
            "receive.message.max.bytes": fetch_max + _FRAMING_BYTES,
            "queued.max.messages.kbytes": max(64 * 1024, 2 * fetch_max // 1024),
            # When that queue is full librdkafka pauses fetching for fetch.queue.backoff.ms (1 s by default):
            # a trainer that drains a deep backlog faster than that would then wait up to a second per take.
            "fetch.queue.backoff.ms": 20,
            **self.common(),
            **(overrides or {}),
        }
        return _with_guarantees(conf, _CONSUMER_GUARANTEES)

    def admin(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """An admin client config."""
        return {**self.common(), **(overrides or {})}


def _with_guarantees(conf: dict[str, Any], guarantees: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in guarantees.items():
        if key in conf and str(conf[key]).lower() != str(value).lower():
            raise ConfigError(f"{key}={conf[key]!r} would break a rollstream guarantee; "
                              f"remove it from the Kafka config (rollstream sets {key}={value})")
        conf[key] = value
    return conf
