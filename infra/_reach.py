"""The startup check every command and client makes first: the cluster answers, this principal may log in,
and the topics it needs exist and are visible to it; one clear line for each way that fails, within a
bounded time, with librdkafka's own log lines captured instead of printed. Re-exported by `rollstream.infra.kafka_io`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ClusterMetadata
from rollstream.infra._tls_probe import speaks_tls, verify_failure
from rollstream.infra.clients import open_admin
from rollstream.infra.config import BOOTSTRAP_ENV, KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import (
    NOT_AUTHORIZED,
    KafkaIOError,
    UnreachableClusterError,
    authentication_error,
    error_text,
    kafka_error,
    missing_namespace_error,
    missing_topic_error,
    namespaces_in,
    not_authorized_error,
    plaintext_on_tls_error,
    tls_error,
)

_AUTH_ATTEMPT_S = 1.0  # one metadata attempt of require_topics (a SCRAM login is refused after ~0.3 s)
_LAST_ATTEMPT_S = 0.01  # the shortest metadata attempt: librdkafka's 0 means "cached only"
_KINDS = ("prompts", "rollouts", "steps", "control")  # a namespace's topics (rollstream.infra.TopicNames)
REACH_TIMEOUT_S = 15.0  # how long a command waits for an unreachable cluster before its one-line error


def require_topics(config: KafkaConfig, topics: Sequence[str], *, namespace: str, timeout: float | Deadline) -> None:
    """Verify the broker answers within `timeout` (seconds or a `Deadline`: all its reads together) and every
    topic in `topics` exists. Blocks up to `timeout`; call off-loop.

    Raises:
        KafkaIOError (retriable): the broker did not answer; the message names the address and the fix.
        MissingNamespaceError: no topic of `namespace` exists (`missing_namespace_error`: a misspelt namespace
            or topics never created); the message lists the namespaces that do exist.
        KafkaIOError: a topic is missing (`missing_topic_error`); the message says to run
            ``rollstream topics create --namespace NS``.
    """
    # librdkafka's own lines go to `seen`, not stderr: they would repeat what the error below says, and
    # they are where a refused login shows (an authentication failure is no "cannot reach"). All of them, at
    # librdkafka's default level (6), whatever the `librdkafka` logger shows (`KafkaConfig.common`'s log_level).
    seen = _SeenLog()
    admin = open_admin(config.admin({"logger": seen, "log_level": 6, "error_cb": seen.error,
                                     "log.connection.close": True}))
    deadline = Deadline.of(timeout)
    try:
        metadata = _list_or_refused(admin, seen, config, deadline)
    except KafkaException as exc:
        cause = kafka_error("list topics", exc)
        raise UnreachableClusterError(
            f"cannot reach Kafka at {config.bootstrap_servers} within {deadline.total_s:g} s ({error_text(exc)}); "
            f"start one (rollstream broker start) or set {BOOTSTRAP_ENV} / --bootstrap-servers to a running "
            "broker", code=cause.code, fatal=cause.fatal, retriable=True) from exc
    missing = [t for t in topics if t not in metadata.topics]
    for topic in missing:  # a topic this principal may not Describe is left out of the listing
        _check_authorized(admin, topic, namespace, deadline)
    if missing and not any(f"{namespace}.{kind}" in metadata.topics for kind in _KINDS):
        raise missing_namespace_error(namespace, config.bootstrap_servers, namespaces_in(metadata.topics))
    if len(missing) == 1:
        raise missing_topic_error(missing[0], namespace)
    if missing:
        raise KafkaIOError(f"topics {', '.join(missing)} do not exist on {config.bootstrap_servers}: "
                           f"run 'rollstream topics create --namespace {namespace}' first",
                           code="UNKNOWN_TOPIC_OR_PART")


class _SeenLog:
    """librdkafka's log lines and error events of one client, kept (not printed) to tell why it failed."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, level: int, msg: str, *args: Any) -> None:  # noqa: ARG002 - confluent's signature
        if len(self.lines) < 200:
            self.lines.append(msg % args if args else msg)

    def error(self, err: KafkaError) -> None:
        if len(self.lines) < 200:
            self.lines.append(f"{err.name()}: {err.str()}")

    def refusal(self, config: KafkaConfig) -> KafkaIOError | None:
        """The TLS or authentication error the lines show, if any: a failed handshake (`tls_error`), a plaintext
        client on a TLS port, a wrong password, or no SASL for a SASL listener."""
        lines = self.lines
        if any("certificate verify failed" in line for line in lines):  # which reason: OpenSSL's verify result
            reason = verify_failure(config.bootstrap_servers, config.extra)
            lines = [*lines, reason] if reason else lines
        failed = tls_error(config.bootstrap_servers, lines)
        if failed is not None:
            return failed
        protocol = str(config.extra.get("security.protocol", "PLAINTEXT"))
        closed = any("closed by peer" in line for line in self.lines)
        if closed and not protocol.upper().endswith("SSL") and speaks_tls(config.bootstrap_servers):
            return plaintext_on_tls_error(config.bootstrap_servers, protocol)
        for line in self.lines:
            if "SASL authentication error" in line or line.startswith(("_AUTHENTICATION", "SASL_AUTHENTICATION")):
                return authentication_error(config.bootstrap_servers, line[line.find("SASL"):].strip())
        if "sasl.mechanism" not in config.extra and closed:
            # The broker accepted the connection, then closed it at the first request: it expects a handshake
            # this client did not do (a SASL or SSL listener, PLAINTEXT client).
            return KafkaIOError(f"Kafka at {config.bootstrap_servers} closed every connection at once: it likely "
                                "requires authentication; set security.protocol and sasl.mechanism / "
                                "sasl.username / sasl.password in a --kafka-config file", code="_AUTHENTICATION")
        return None


def _list_or_refused(admin: AdminClient, seen: _SeenLog, config: KafkaConfig, deadline: Deadline) -> ClusterMetadata:
    """``list_topics`` within `deadline`, in short attempts so that a refused login fails at once (~0.5 s).

    Raises:
        KafkaIOError: the broker refused the login (`_SeenLog.refusal`).
        KafkaException: no answer within `deadline`.
    """
    while True:
        try:
            return admin.list_topics(timeout=max(_LAST_ATTEMPT_S, deadline.seconds(_AUTH_ATTEMPT_S)))
        except KafkaException as exc:
            admin.poll(0.05)  # delivers the log lines and error events of the failed attempt to `seen`
            refused = seen.refusal(config)
            if refused is not None:
                raise refused from exc
            if deadline.expired:
                raise


def _check_authorized(admin: AdminClient, topic: str, namespace: str, deadline: Deadline) -> None:
    if deadline.expired:
        return  # the missing-topic error that follows is still true enough
    try:
        info = admin.list_topics(topic, timeout=deadline.seconds(REACH_TIMEOUT_S)).topics.get(topic)
    except KafkaException:
        return  # the missing-topic error that follows is still true enough
    if info is not None and info.error is not None and info.error.name() in NOT_AUTHORIZED:
        raise not_authorized_error(info.error.name(), topic, namespace)
