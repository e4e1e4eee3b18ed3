"""Which rebalance protocol a consumer group speaks: classic (JoinGroup/SyncGroup, assignment by a member) or
consumer (KIP-848: assignment by the broker's group coordinator, carried by heartbeats), and the client
properties each one takes.

Contract:
- `resolve_group_protocol` turns ``auto`` into ``classic`` or ``consumer`` once, at start: ``consumer`` only
  where the broker says it serves it (its ``group.coordinator.rebalance.protocols`` lists ``consumer``:
  Kafka 4.0 on by default, 3.7-3.9 only when enabled; from 5.0, which drops that setting, a broker with
  ``group.consumer.*`` settings) *and* `AUTO_PREFERS` is ``consumer``, for a dynamic member (a static one keeps
  the classic protocol). It says why, for the caller's one log line. A broker whose configs cannot be read
  (no ``DESCRIBE_CONFIGS`` on the cluster) gets ``classic``, which every broker serves.
- `group_conf` gives a member's protocol properties. librdkafka (>= 2.10) refuses ``session.timeout.ms``,
  ``heartbeat.interval.ms`` and ``partition.assignment.strategy`` with ``group.protocol=consumer`` (the broker
  owns the session and the assignor there), so they are removed from whatever else supplied them (the typed
  setting wins, as everywhere in `rollstream.infra.config`).
- `set_group_session` gives a consumer-protocol group the session timeout a classic member would ask for
  itself, as the group's own config (``consumer.session.timeout.ms``, ``consumer.heartbeat.interval.ms``),
  best effort: a broker that refuses it (bounds, ACLs) keeps its own defaults, said in one line.
- A broker without KIP-848 (3.x) does not make a consumer-protocol member fail: librdkafka 2.16 logs
  "ConsumerGroupHeartbeatRequest not supported by broker" at debug level, marks the coordinator dead and asks
  again forever, with no error event, so the member silently never gets a partition. So an explicit
  ``consumer`` is checked against the broker too: one whose configs say it does not serve the consumer
  protocol is a ConfigError at start (one whose configs cannot be read is tried, with a warning).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from confluent_kafka import KafkaException
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, ResourceType
from rollstream.infra.clients import open_admin
from rollstream.infra.config import KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError
from rollstream.infra.topics import admin_answer, in_attempts
from rollstream.schemas import ConfigError

log = logging.getLogger(__name__)

GroupProtocol = Literal["auto", "classic", "consumer"]
GROUP_PROTOCOLS: tuple[GroupProtocol, ...] = ("auto", "classic", "consumer")
Resolved = Literal["classic", "consumer"]
# What ``auto`` picks on a broker that serves both (measured: docs/benchmarks.md, "Prompt group protocols").
AUTO_PREFERS: Resolved = "consumer"
BROKER_PROTOCOLS = "group.coordinator.rebalance.protocols"
KIP848_SETTING = "group.consumer.session.timeout.ms"
# Properties librdkafka refuses (or ignores) with group.protocol=consumer: the broker owns them there.
CLASSIC_ONLY = ("session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy",
                "group.protocol.type")
_MIN_HEARTBEAT_MS = 100


def check_group_protocol(protocol: str) -> None:
    """Raise ConfigError unless `protocol` is one of `GROUP_PROTOCOLS`."""
    if protocol not in GROUP_PROTOCOLS:
        raise ConfigError(f"group_protocol={protocol!r}: use auto (the consumer protocol, KIP-848, where the broker "
                          "serves it), classic or consumer")


def heartbeat_ms(session_timeout_s: float) -> int:
    """The heartbeat interval for a session of `session_timeout_s`: a quarter of it, at least 100 ms."""
    return max(_MIN_HEARTBEAT_MS, int(session_timeout_s * 1000) // 4)


def group_conf(protocol: Resolved, conf: Mapping[str, Any], session_timeout_s: float) -> dict[str, Any]:
    """`conf` (a member's properties) with `protocol`'s own: classic gets a session of `session_timeout_s` and
    cooperative-sticky assignment; consumer gets none of `CLASSIC_ONLY` (see the module docstring)."""
    if protocol == "classic":
        return {"session.timeout.ms": int(session_timeout_s * 1000), "heartbeat.interval.ms": heartbeat_ms(
            session_timeout_s), **conf, "partition.assignment.strategy": "cooperative-sticky",
            "group.protocol": "classic"}
    dropped = sorted(key for key in CLASSIC_ONLY if key in conf)
    if dropped:
        log.debug("group.protocol=consumer: %s left out (the broker owns them under KIP-848)", dropped)
    return {**{k: v for k, v in conf.items() if k not in CLASSIC_ONLY}, "group.protocol": "consumer"}


def broker_protocols(kafka: KafkaConfig, timeout: float) -> tuple[str, ...] | None:
    """The group protocols the broker serves (``group.coordinator.rebalance.protocols`` of one broker; a broker
    without it serves classic only, unless it has the consumer protocol's settings), or None when its configs
    cannot be read (no DESCRIBE_CONFIGS on the cluster; unreachable). Blocks up to about 2 x `timeout`."""
    admin = open_admin(kafka.admin())
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        if not brokers:
            return None
        resource = ConfigResource(ResourceType.BROKER, str(min(brokers)))
        entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result(timeout)
    except (KafkaException, TimeoutError) as exc:
        log.debug("cannot read %s: %s", BROKER_PROTOCOLS, exc)
        return None
    entry = entries.get(BROKER_PROTOCOLS)
    if entry is not None and entry.value is not None:
        return tuple(p.strip() for p in str(entry.value).split(",") if p.strip())
    # The setting is deprecated from 4.3 (KIP-1237) and goes in 5.0, where both protocols are always on; a
    # broker without it that has the consumer protocol's own settings (3.7 on) is such a one.
    return ("classic", "consumer") if KIP848_SETTING in entries else ("classic",)


def resolve_group_protocol(kafka: KafkaConfig, requested: GroupProtocol, timeout: float, *,
                           static: bool = False) -> tuple[Resolved, str]:
    """`requested`, with ``auto`` decided (see the module docstring), and why, for the caller's one log line.
    `static`: the member has a ``group.instance.id``; ``auto`` then keeps the classic protocol, the only one under
    which a static member restarted after a crash gets its partitions back at once (KIP-848 refuses it until the
    old session ends). Blocks up to about 2 x `timeout` (not at all for ``classic``, or ``auto`` and `static`).

    Raises:
        ConfigError: `requested` is not a protocol, or is ``consumer`` and the broker says it does not serve it.
    """
    check_group_protocol(requested)
    if requested == "classic":
        return "classic", "as configured"
    if requested == "auto" and static:
        return "classic", "auto: a static member, which only the classic protocol lets take its partitions back " \
                          "at once after a crash"
    if requested == "auto" and AUTO_PREFERS == "classic":
        return "classic", "auto: measured faster (docs/benchmarks.md)"
    served = broker_protocols(kafka, timeout)
    unreadable = f"the broker's {BROKER_PROTOCOLS} is unreadable"
    if requested == "consumer":
        if served is not None and "consumer" not in served:
            raise ConfigError(f"group_protocol='consumer' (--group-protocol consumer): the broker does not serve the "
                              f"consumer group protocol (KIP-848, Kafka >= 4.0; its {BROKER_PROTOCOLS} is "
                              f"{','.join(served)}), and librdkafka would wait for it silently forever. Use auto or "
                              "classic, or enable the protocol on the broker")
        return "consumer", "as configured" if served is not None else (
            f"as configured, though {unreadable}: on a broker without KIP-848 this producer never gets a partition")
    if served is None:
        return "classic", f"auto: {unreadable}"
    return ("consumer" if "consumer" in served else "classic"), f"auto: the broker serves {','.join(served)}"


def set_group_session(kafka: KafkaConfig, group: str, session_timeout_s: float, timeout: float) -> bool:
    """Give consumer-protocol group `group` a session of `session_timeout_s` (and heartbeats every quarter of it)
    as its own config; False (logged) when the broker refuses. Blocks up to `timeout`."""
    session_ms, beat_ms = int(session_timeout_s * 1000), heartbeat_ms(session_timeout_s)
    resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
        ConfigEntry("consumer.session.timeout.ms", str(session_ms),
                    incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("consumer.heartbeat.interval.ms", str(beat_ms), incremental_operation=AlterConfigOpType.SET)])

    def attempt(wait_s: float) -> None:
        admin = open_admin(kafka.admin())
        future = admin.incremental_alter_configs([resource], request_timeout=wait_s)[resource]
        admin_answer(future, f"cannot set the configs of prompt group {group}", kafka, wait_s)

    try:
        in_attempts(attempt, timeout)  # a group's configs go to the controller: see `in_attempts`
    except KafkaIOError as exc:
        log.warning("prompt group %s: could not set its session to %g s under the consumer protocol (%s): the "
                    "broker's group.consumer.session.timeout.ms and heartbeat interval apply", group,
                    session_timeout_s, exc)
        return False
    log.debug("prompt group %s: consumer.session.timeout.ms=%d, consumer.heartbeat.interval.ms=%d", group,
              session_ms, beat_ms)
    return True
