"""The topic plan of a namespace: names, partitions, replication and every topic config, explicit.

``NS.prompts`` and ``NS.rollouts`` carry the work; ``NS.steps`` (one partition, ordered) carries the
trainer's step manifests; ``NS.control`` (compacted) carries policy versions; ``NS.inflight`` (compacted, as
many partitions as NS.prompts, small segments so that it stays compact) carries the producers' checkpoints of
samples being generated (`rollstream.producers._inflight`). Retention is by time
and long enough to replay (days); ``max.message.bytes`` is the same number the clients are sized
from (`KafkaConfig.max_message_bytes`), so a group the producer accepts is one the topic and the
consumer accept too.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic
from rollstream.infra.clients import open_admin
from rollstream.infra.config import DEFAULT_MAX_MESSAGE_BYTES, KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import NOT_AUTHORIZED, UNREACHABLE, KafkaIOError, kafka_error
from rollstream.schemas import ConfigError, RollstreamError

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_TOLERATED = object()  # what `_answer` returns for the error it was told to accept
_NAMESPACE = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_DAY_MS = 24 * 3600 * 1000
_INFLIGHT_SEGMENT_MS = 10 * 60 * 1000
_INFLIGHT_TOMBSTONE_MS = 3600 * 1000


@dataclass(frozen=True)
class TopicNames:
    """The topics of one namespace."""

    namespace: str = "rollstream"

    def __post_init__(self) -> None:
        if not _NAMESPACE.match(self.namespace):
            raise ConfigError(f"namespace {self.namespace!r} must be 1-200 letters, digits, '_' or '-'")

    @property
    def prompts(self) -> str:
        return f"{self.namespace}.prompts"

    @property
    def rollouts(self) -> str:
        return f"{self.namespace}.rollouts"

    @property
    def steps(self) -> str:
        return f"{self.namespace}.steps"

    @property
    def control(self) -> str:
        return f"{self.namespace}.control"

    @property
    def inflight(self) -> str:
        """In-flight checkpoints (compacted): the newest state of each sample being generated."""
        return f"{self.namespace}.inflight"

    @property
    def producer_group(self) -> str:
        """The producers' default consumer group on NS.prompts (``--intake-group`` overrides it)."""
        return f"{self.namespace}.producers"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int
    config: dict[str, str]


@dataclass(frozen=True)
class TopicPlan:
    """Partitions, replication and configs for every topic of a namespace.

    Attributes:
        partitions: partitions of the prompts and rollouts topics (the unit of producer parallelism).
        replication_factor: replicas of every topic (3 in production, 1 on a single local broker).
        min_insync_replicas: replicas that must have a write before acks=all succeeds;
            default ``min(2, replication_factor)``.
        retention_days: time retention of prompts, rollouts and steps (long enough to replay).
        max_message_bytes: the largest record; clients are sized from the same number.
        compression: topic compression; matches the producers' so the broker never recompresses.
    """

    names: TopicNames = TopicNames()
    partitions: int = 3
    replication_factor: int = 1
    min_insync_replicas: int | None = None
    retention_days: float = 7.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    compression: str = "lz4"

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ConfigError(f"partitions={self.partitions}: need at least 1")
        if self.replication_factor < 1:
            raise ConfigError(f"replication_factor={self.replication_factor}: need at least 1")
        if self.min_insync_replicas is not None and not 1 <= self.min_insync_replicas <= self.replication_factor:
            raise ConfigError(f"min_insync_replicas={self.min_insync_replicas} must be between 1 and "
                              f"replication_factor={self.replication_factor}")
        if self.retention_days <= 0:
            raise ConfigError(f"retention_days={self.retention_days} must be positive")

    @property
    def min_isr(self) -> int:
        return self.min_insync_replicas or min(2, self.replication_factor)

    def topics(self) -> list[TopicSpec]:
        """Every topic of the namespace with its full, explicit configuration."""
        base = {
            "min.insync.replicas": str(self.min_isr),
            "max.message.bytes": str(self.max_message_bytes),
            "compression.type": self.compression,
            "cleanup.policy": "delete",
            "retention.ms": str(int(self.retention_days * _DAY_MS)),
            "retention.bytes": "-1",
        }
        compacted = {**base, "cleanup.policy": "compact", "retention.ms": "-1"}
        # checkpoints are rewritten often and read whole when a partition moves: segments roll every 10 min and
        # are cleaned early, tombstones kept an hour (a reader that started before one still sees it)
        inflight = {**compacted, "segment.ms": str(_INFLIGHT_SEGMENT_MS), "min.cleanable.dirty.ratio": "0.1",
                    "delete.retention.ms": str(_INFLIGHT_TOMBSTONE_MS)}
        n, rf = self.names, self.replication_factor
        return [
            TopicSpec(n.prompts, self.partitions, rf, base),
            TopicSpec(n.rollouts, self.partitions, rf, base),
            TopicSpec(n.steps, 1, rf, base),
            TopicSpec(n.control, 1, rf, compacted),
            TopicSpec(n.inflight, self.partitions, rf, inflight),
        ]

    def kafka_config(self, config: KafkaConfig) -> KafkaConfig:
        """`config` with client size limits taken from this plan."""
        return replace(config, max_message_bytes=self.max_message_bytes)


def create_topics(plan: TopicPlan, config: KafkaConfig, *, timeout: float = 30.0) -> dict[str, str]:
    """Create every topic of `plan` that does not exist yet (idempotent), and wait until every partition of
    the new ones has a leader, so they are usable when this returns. Blocks up to about 2 x `timeout` s.

    Returns:
        topic name -> "created" or "exists". An existing topic is left as it is (its configs are
        not altered; `describe_topics` shows them).
    Raises:
        KafkaIOError: the broker refused a topic (e.g. replication factor above the broker count),
            or did not answer within `timeout` (retriable).
    """
    admin = open_admin(config.admin())
    new = [NewTopic(t.name, num_partitions=t.partitions, replication_factor=t.replication_factor,
                    config=t.config) for t in plan.topics()]
    futures = admin.create_topics(new, request_timeout=timeout, operation_timeout=timeout)
    result: dict[str, str] = {}
    for name, future in futures.items():
        if admin_answer(future, f"cannot create topic {name}", config, timeout, topic=name,
                        ok=KafkaError.TOPIC_ALREADY_EXISTS) is _TOLERATED:
            result[name] = "exists"
        else:
            result[name] = "created"
            log.info("created topic %s", name)
    _wait_for_leaders(admin, [n for n, how in result.items() if how == "created"], config, timeout)
    return result


def _wait_for_leaders(admin: AdminClient, topics: list[str], config: KafkaConfig, timeout: float) -> None:
    """Block until every partition of `topics` has a leader: a topic is usable when `create_topics` returns."""
    deadline = time.monotonic() + timeout
    while topics:
        try:
            meta = admin.list_topics(timeout=max(0.1, deadline - time.monotonic())).topics
        except KafkaException as exc:
            raise _no_answer(f"cannot confirm topics {', '.join(topics)}", config, timeout) from exc
        topics = [t for t in topics if t not in meta or meta[t].error is not None
                  or not meta[t].partitions or any(p.leader < 0 for p in meta[t].partitions.values())]
        if topics and time.monotonic() >= deadline:
            raise KafkaIOError(f"topics {', '.join(topics)} were created but have no leader after {timeout:g} s; "
                               "is the cluster healthy (rollstream broker status)?",
                               topic=topics[0] if len(topics) == 1 else None, code="LEADER_NOT_AVAILABLE",
                               retriable=True)
        if topics:
            time.sleep(0.05)


def existing_topics(config: KafkaConfig, names: list[str], timeout: float = 30.0) -> list[str]:
    """Those of `names` the cluster has (blocks up to `timeout` s). Raises KafkaIOError when it does not answer."""
    try:
        meta = open_admin(config.admin()).list_topics(timeout=timeout).topics
    except KafkaException as exc:
        raise _no_answer(f"cannot list the topics {', '.join(names)}", config, timeout) from exc
    return [n for n in names if n in meta and meta[n].error is None]


def describe_topic_configs(names: list[str], config: KafkaConfig, *, timeout: float = 30.0
                           ) -> dict[str, dict[str, str]]:
    """Read topic configs back from the broker (blocks up to `timeout` s).

    Raises:
        KafkaIOError: a topic does not exist, or the broker did not answer within `timeout` (retriable).
    """
    def attempt(wait_s: float) -> dict[str, dict[str, str]]:
        admin = open_admin(config.admin())
        futures = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names],
                                         request_timeout=wait_s)
        out: dict[str, dict[str, str]] = {}
        for resource, future in futures.items():
            entries: dict[str, Any] = admin_answer(future, f"cannot describe topic {resource.name}", config,
                                                   wait_s, topic=resource.name)
            out[resource.name] = {k: v.value for k, v in entries.items()}
        return out
    return in_attempts(attempt, timeout)


FIRST_ATTEMPT_S = 4.0  # a broker answers an admin request in ms; under a heavy load in a few seconds
_PAUSE_S = 0.2


def in_attempts(attempt: Callable[[float], _T], timeout: float) -> _T:
    """`attempt(wait_s)`, made again with a fresh client while it gets no answer (a retriable KafkaIOError) and
    `timeout` lasts: the first may wait `FIRST_ATTEMPT_S`, each next one twice as long as the one before, the
    last what is left. Blocks up to `timeout` (plus the last attempt's wake-up); raises what the last attempt raised.

    For admin requests librdkafka sends to the controller (a topic's or a group's configs): it looks the
    controller up once, and a metadata answer naming no broker (a KRaft node that stalled is fenced for a
    moment as it comes back) leaves the request waiting its whole timeout, though the broker answers the next
    client at once (librdkafka 2.16; seen after a 12-30 s SIGSTOP of a KRaft node, docs/operations.md).
    """
    deadline = Deadline.after(timeout)
    wait_s = FIRST_ATTEMPT_S
    while True:
        try:
            return attempt(deadline.seconds(wait_s) or 0.001)
        except KafkaIOError as exc:
            if not exc.retriable or deadline.expired:
                raise
            log.debug("%s: asking again with a fresh client (%.1f s left)", exc, deadline.remaining())
        time.sleep(deadline.seconds(_PAUSE_S))  # an error that came back at once is not asked again at once
        wait_s *= 2


def alter_topics(names: TopicNames, config: KafkaConfig, *, max_message_bytes: int | None = None,
                 retention_days: float | None = None, timeout: float = 30.0) -> dict[str, dict[str, tuple[str, str]]]:
    """Change the limits of a namespace's existing topics the way `TopicPlan` sets them at creation:
    ``max.message.bytes`` on all of them, ``retention.ms`` on the time-retained three (NS.control and NS.inflight
    are compacted and keep their own; a namespace created before NS.inflight existed is altered without it).
    Idempotent: a value already set is left alone. Blocks up to about 2 x `timeout` s.

    Producers and trainers read ``max.message.bytes`` at start (`sized_to_topic`): restart them to use a new one.

    Returns:
        topic -> config key -> (old value, new value), for the values it changed (empty: nothing to change).
    Raises:
        ConfigError: neither value given, or one out of range.
        KafkaIOError: a topic does not exist, this principal may not alter topic configs, or the broker did
            not answer within `timeout` (retriable).
    """
    if max_message_bytes is None and retention_days is None:
        raise ConfigError("alter_topics: give max_message_bytes or retention_days (or both)")
    if max_message_bytes is not None and max_message_bytes < 1:
        raise ConfigError(f"max_message_bytes={max_message_bytes} must be positive")
    plan = TopicPlan(names, retention_days=retention_days or 1.0, max_message_bytes=max_message_bytes or 1)
    keys = [k for k, given in (("max.message.bytes", max_message_bytes), ("retention.ms", retention_days))
            if given is not None]
    topics = [t for t in plan.topics() if t.name != names.inflight or existing_topics(config, [t.name], timeout)]
    current = describe_topic_configs([t.name for t in topics], config, timeout=timeout)
    changes = {t.name: {k: (current[t.name].get(k) or "", t.config[k]) for k in keys
                        if current[t.name].get(k) != t.config[k]
                        and not (k == "retention.ms" and t.config["cleanup.policy"] == "compact")}
               for t in topics}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name, incremental_configs=[
        ConfigEntry(k, new, incremental_operation=AlterConfigOpType.SET) for k, (_, new) in changed.items()])
        for name, changed in changes.items() if changed]
    if resources:
        admin = open_admin(config.admin())
        for resource, future in admin.incremental_alter_configs(resources, request_timeout=timeout).items():
            try:
                admin_answer(future, f"cannot alter topic {resource.name}", config, timeout, topic=resource.name)
            except KafkaIOError as exc:
                if exc.code not in NOT_AUTHORIZED:
                    raise
                raise KafkaIOError(f"not authorized to alter topic {resource.name} on {config.bootstrap_servers}: "
                                   "altering topic configs is an admin's operation; run it with an admin "
                                   "principal's --kafka-config (the SASL broker's admin.properties)",
                                   topic=resource.name, code=exc.code) from exc
            log.info("altered topic %s: %s", resource.name, changes[resource.name])
    return {name: changed for name, changed in changes.items() if changed}


def sized_to_topic(config: KafkaConfig, topic: str, *, timeout: float = 10.0) -> KafkaConfig:
    """`config` with its client size limits taken from `topic`'s ``max.message.bytes`` on the broker.

    So a producer or trainer fits the topics that ``rollstream topics create --max-message-mib`` made,
    whatever its own default: a consumer sized below the topic could not fetch its largest records, a
    producer sized above it would have them refused. Blocks up to `timeout` s. When the broker does not
    say (no DescribeConfigs permission, no answer), returns `config` unchanged and logs a warning.
    """
    try:
        value = int(describe_topic_configs([topic], config, timeout=timeout)[topic]["max.message.bytes"])
    except (RollstreamError, KeyError, ValueError) as exc:
        log.warning("cannot read max.message.bytes of %s (%s); clients keep max_message_bytes=%d", topic, exc,
                    config.max_message_bytes)
        return config
    if value != config.max_message_bytes:
        log.info("clients sized from %s: max.message.bytes=%d (configured %d)", topic, value,
                 config.max_message_bytes)
        config = replace(config, max_message_bytes=value)
    return config


def admin_answer(future: Future[Any], what: str, config: KafkaConfig, timeout: float, *,
                 topic: str | None = None, ok: int | None = None) -> Any:
    """The result of an admin `future` about `topic`, or `_TOLERATED` when it failed with the error code `ok`.

    Raises KafkaIOError saying `what` failed (mapped by `rollstream.infra.kafka_errors.kafka_error`; retriable when the
    broker did not answer within `timeout`)."""
    try:
        value = future.result(timeout=timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else None
        code = err.code() if isinstance(err, KafkaError) else None
        if ok is not None and code == ok:
            return _TOLERATED
        if code in UNREACHABLE:
            raise _no_answer(what, config, timeout, topic, code=err.name() if isinstance(err, KafkaError) else None
                             ) from exc
        raise kafka_error(what, exc, topic=topic) from exc
    except TimeoutError as exc:
        raise _no_answer(what, config, timeout, topic) from exc
    return value


def _no_answer(what: str, config: KafkaConfig, timeout: float, topic: str | None = None, *,
               code: str | None = "_TIMED_OUT") -> KafkaIOError:
    return KafkaIOError(f"{what}: no answer from {config.bootstrap_servers} within {timeout:g} s; is a "
                        "Kafka broker listening there (rollstream broker status)?", topic=topic, code=code,
                        retriable=True)
