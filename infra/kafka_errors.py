"""The one mapping of librdkafka errors to rollstream's: `KafkaIOError` says what failed, where
(``topic[partition]``), librdkafka's error name (`code`), whether the client is dead (`fatal`) and whether
retrying can help (`retriable`: librdkafka says so, or the broker did not answer: a timeout, a transport
error, all brokers down). Every librdkafka failure in infra, producers and consumers goes through
`kafka_error`. Pure: no I/O.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from confluent_kafka import KafkaError, KafkaException
from rollstream.schemas import RollstreamError

# librdkafka's codes for "the broker did not answer" (none listening, too slow, connection lost; _DESTROY_BROKER:
# the broker left the cluster's metadata while a request waited on it, librdkafka >= 2.10 decommissions its
# handle, and the next try goes to the broker that leads now).
UNREACHABLE = frozenset({KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN,
                         KafkaError._TIMED_OUT_QUEUE, KafkaError._DESTROY_BROKER})
# A partition without a leader for a moment (librdkafka says "unknown partition" until metadata has one).
NO_LEADER = frozenset({"_UNKNOWN_PARTITION", "LEADER_NOT_AVAILABLE", "NOT_LEADER_FOR_PARTITION"})
NO_TOPIC = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
# A consumer group's coordinator moving (its __consumer_offsets partition led by another node, loading there): the
# broker asked is not, or not yet, the coordinator; librdkafka looks it up again, and the next request finds it.
NO_COORDINATOR = frozenset({"NOT_COORDINATOR", "COORDINATOR_NOT_AVAILABLE", "COORDINATOR_LOAD_IN_PROGRESS"})
# What to do about the errors a user can fix, by librdkafka error name.
HINTS = {
    "MSG_SIZE_TOO_LARGE": "the record exceeds max.message.bytes: raise it (rollstream topics create "
                          "--max-message-mib) or make the records smaller",
    "_MSG_TIMED_OUT": "the broker did not acknowledge in time: is the cluster healthy (rollstream broker status)?",
    "UNKNOWN_TOPIC_OR_PART": "run 'rollstream topics create' first",
    "_UNKNOWN_TOPIC": "run 'rollstream topics create' first",
    **dict.fromkeys(NO_COORDINATOR, "the group's coordinator is moving (a broker node restarting, stalled or just "
                                    "started): retrying may help; is the cluster healthy (rollstream broker status)?"),
    "TOPIC_AUTHORIZATION_FAILED": "not authorized: grant this principal access to the topic (rollstream acls --apply)",
    "GROUP_AUTHORIZATION_FAILED": "not authorized: grant this principal access to its consumer group "
                                  "(rollstream acls --apply)",
    "CLUSTER_AUTHORIZATION_FAILED": "not authorized for this cluster operation: use a principal allowed to do it "
                                    "(the SASL broker's admin.properties); rollstream acls prints what each role needs",
    "_AUTHENTICATION": "authentication failed: check sasl.mechanism, sasl.username and sasl.password in the "
                       "--kafka-config file",
    "SASL_AUTHENTICATION_FAILED": "authentication failed: check sasl.mechanism, sasl.username and sasl.password "
                                  "in the --kafka-config file",
}
# Authentication and authorization refusals: never retriable (the same credentials get the same answer).
AUTHENTICATION = frozenset({"_AUTHENTICATION", "SASL_AUTHENTICATION_FAILED", "UNSUPPORTED_SASL_MECHANISM",
                            "ILLEGAL_SASL_STATE"})
NOT_AUTHORIZED = {"TOPIC_AUTHORIZATION_FAILED": "topic", "GROUP_AUTHORIZATION_FAILED": "consumer group",
                  "CLUSTER_AUTHORIZATION_FAILED": "cluster",
                  "TRANSACTIONAL_ID_AUTHORIZATION_FAILED": "transactional id"}


class KafkaIOError(RollstreamError):
    """A Kafka read or write failed.

    Attributes:
        topic, partition: where (None when not known or not about one partition).
        code: librdkafka's error name (``"_TIMED_OUT"``, ``"MSG_SIZE_TOO_LARGE"``), None when it gave none.
        fatal: the client cannot be used any more (librdkafka said fatal): close it and make a new one.
        retriable: the same call may succeed later without any change (see the module docstring).
    """

    def __init__(self, message: str, *, topic: str | None = None, partition: int | None = None,
                 code: str | None = None, fatal: bool = False, retriable: bool = False) -> None:
        super().__init__(message, retriable=retriable)
        self.topic = topic
        self.partition = partition
        self.code = code
        self.fatal = fatal


class CommitFailed(KafkaIOError):
    """`commit_offsets` did not commit every partition.

    Attributes:
        failed: partition -> error text; every partition asked for when the whole call failed, so a
            caller that retries per partition retries exactly these.
    """

    def __init__(self, message: str, failed: Mapping[int, str], *, topic: str, code: str | None = None,
                 fatal: bool = False, retriable: bool = True) -> None:
        only = next(iter(failed)) if len(failed) == 1 else None
        super().__init__(message, topic=topic, partition=only, code=code, fatal=fatal, retriable=retriable)
        self.failed = dict(failed)


def where(topic: str | None, partition: int | None = None) -> str:
    """``topic[partition]``, ``topic``, or "" when neither is known."""
    if topic is None:
        return ""
    return topic if partition is None else f"{topic}[{partition}]"


def kafka_error(what: str, error: KafkaException | KafkaError, *, topic: str | None = None,
                partition: int | None = None) -> KafkaIOError:
    """THE mapping of a librdkafka error to a `KafkaIOError`: `what` failed, at `topic[partition]`.

    Retriable when librdkafka says so or the broker did not answer (timeout, transport, all brokers
    down); `fatal` as librdkafka says. The message ends with what to do. Raises nothing (returns).
    """
    err: KafkaError | None
    if isinstance(error, KafkaException):
        first = error.args[0] if error.args else None
        err = first if isinstance(first, KafkaError) else None
    else:
        err = error
    if err is None:  # a KafkaException without a KafkaError: librdkafka gave nothing to go by
        text, code, fatal, retriable = str(error), None, False, True
    else:
        text, code, fatal = err.str(), err.name(), err.fatal()
        retriable = not fatal and (err.retriable() or err.code() in UNREACHABLE or code in NO_COORDINATOR)
    if fatal:
        hint = "the client cannot recover: close it and start again"
    elif code in HINTS:
        hint = HINTS[code]
    elif retriable:
        hint = "retrying may help; is the broker up (rollstream broker status)?"
    else:
        hint = "see the broker log"
    place = where(topic, partition)
    message = f"{what}{f' ({place})' if place and place not in what else ''}: {text}; {hint}"
    return KafkaIOError(message, topic=topic, partition=partition, code=code, fatal=fatal, retriable=retriable)


def authentication_error(bootstrap: str, detail: str) -> KafkaIOError:
    """The one "authentication failed" error (wrong password, user or mechanism; not "cannot reach")."""
    return KafkaIOError(f"authentication to Kafka at {bootstrap} failed ({detail}); check sasl.mechanism, "
                        "sasl.username and sasl.password in the --kafka-config file (rollstream broker start --sasl "
                        "writes one per user into its data dir)", code="_AUTHENTICATION")


def not_authorized_error(code: str, name: str | None, namespace: str | None = None) -> KafkaIOError:
    """The one "not authorized" error: names the topic or group (``code`` is one of ``NOT_AUTHORIZED``) and the fix."""
    kind = NOT_AUTHORIZED.get(code, "resource")
    ns = namespace or "NS"
    return KafkaIOError(f"not authorized for {kind}{f' {name}' if name else ''}: grant this principal its ACLs "
                        f"(as an admin: rollstream acls --namespace {ns} --producer-principal P --trainer-principal T "
                        "--apply; see docs/security.md)",
                        topic=name if kind == "topic" else None, code=code)


def missing_topic_error(topic: str, namespace: str | None = None) -> KafkaIOError:
    """The one "topic does not exist" error: names the topic and the command that creates it."""
    command = "rollstream topics create" + (f" --namespace {namespace}" if namespace else "")
    return KafkaIOError(f"topic {topic} does not exist: run '{command}' first", topic=topic,
                        code="UNKNOWN_TOPIC_OR_PART")


class UnreachableClusterError(KafkaIOError):
    """No broker of the cluster answered at all within the reach timeout: a wrong address, or a cluster that is
    down. Retriable (a cluster that starts answers), but a command that has never reached the cluster says so
    and stops rather than waiting for one that may never come."""


class MissingNamespaceError(KafkaIOError):
    """No topic of a namespace exists: a misspelt ``--namespace``, or topics never created there.

    Attributes:
        namespace: the namespace asked for.
        existing: the namespaces the cluster has (those with an NS.rollouts topic), sorted.
    """

    def __init__(self, message: str, *, namespace: str, existing: list[str]) -> None:
        super().__init__(message, code="UNKNOWN_TOPIC_OR_PART")
        self.namespace = namespace
        self.existing = existing


_NAMESPACES_SHOWN = 5  # a shared cluster can hold hundreds; the closest names come first


def namespaces_in(topics: Collection[str]) -> list[str]:
    """The namespaces among `topics`: every NS with an NS.rollouts topic, sorted."""
    return sorted(t.removesuffix(".rollouts") for t in topics if t.endswith(".rollouts"))


def missing_namespace_error(namespace: str, bootstrap: str, existing: list[str]) -> MissingNamespaceError:
    """The one "this namespace has no topics" error: the namespaces that exist (closest first) and both fixes."""
    close = difflib.get_close_matches(namespace, existing, n=3, cutoff=0.6)
    shown = close + [ns for ns in existing if ns not in close][:max(0, _NAMESPACES_SHOWN - len(close))]
    more = f" and {len(existing) - len(shown)} more" if len(existing) > len(shown) else ""
    there = f"namespaces there: {', '.join(shown)}{more}" if existing else "no namespace has topics there yet"
    hint = f"did you mean --namespace {close[0]}? Else " if close else ""
    return MissingNamespaceError(
        f"namespace {namespace} has no topics on {bootstrap} ({there}): {hint}run 'rollstream topics create "
        f"--namespace {namespace}' first, or pass the --namespace (ROLLSTREAM_NAMESPACE) of one that exists",
        namespace=namespace, existing=existing)


def error_text(exc: KafkaException) -> str:
    """librdkafka's own text of `exc` (its KafkaError's ``str()``), else ``str(exc)``."""
    first = exc.args[0] if exc.args else exc
    return first.str() if isinstance(first, KafkaError) else str(first)


# What librdkafka logs for each TLS failure (its OpenSSL texts), in the order they are told apart, and what to do.
_CA_HINT = ("set ssl.ca.location in the --kafka-config file to the CA that signed the broker's certificate "
            "(rollstream broker start --tls writes it to DATA_DIR/tls/ca.pem)")
TLS_CASES: tuple[tuple[tuple[str, ...], str, str], ...] = (
    (("connecting to a PLAINTEXT broker listener", "wrong version number", "packet length too long"),
     "this client speaks TLS but the port does not",
     "use security.protocol=PLAINTEXT or SASL_PLAINTEXT for this port, or the broker's TLS port"),
    (("alert certificate expired",),
     "the broker refused this client's certificate: it has expired",
     "have a new one issued (rollstream broker start --mtls makes them in DATA_DIR/tls/)"),
    (("alert bad certificate", "alert certificate required", "alert unknown ca", "alert handshake failure"),
     "the broker requires a client certificate it trusts (mutual TLS) and got none, or one from another CA",
     "set ssl.certificate.location and ssl.key.location to this principal's certificate and key "
     "(rollstream broker start --mtls writes DATA_DIR/tls/<principal>.pem and .key)"),
    (("certificate has expired",),
     "the broker's certificate has expired",
     "restart the broker so it gets a new one (rollstream broker start --tls remakes it at each start)"),
    (("hostname mismatch", "ip address mismatch", "hostname verification failed"),
     "the broker's certificate does not name the host in the bootstrap address",
     "connect by a name or IP its subjectAltName holds (the local broker's: its host, 127.0.0.1, localhost)"),
    (("certificate verify failed",),
     "the broker's certificate is not signed by a CA this client trusts (wrong or missing ssl.ca.location)",
     _CA_HINT),
)


def tls_error(bootstrap: str, lines: list[str]) -> KafkaIOError | None:
    """The one "TLS handshake failed" error the librdkafka log ``lines`` show, if any: which case it is and what to
    change (wrong CA, expired or mismatched certificate, a TLS client on a plaintext port, a missing client cert)."""
    lowered = [line.lower() for line in lines]
    for needles, what, fix in TLS_CASES:
        if any(needle.lower() in line for line in lowered for needle in needles):
            return KafkaIOError(f"TLS to Kafka at {bootstrap} failed: {what}; {fix}", code="_SSL")
    return None


def plaintext_on_tls_error(bootstrap: str, protocol: str) -> KafkaIOError:
    """The one error for a client without TLS (``protocol``) against a port that speaks TLS."""
    wanted = "SASL_SSL" if protocol.upper().startswith("SASL") else "SSL (or SASL_SSL with SASL)"
    return KafkaIOError(f"TLS to Kafka at {bootstrap} failed: the port speaks TLS but this client does not "
                        f"(security.protocol={protocol}): set security.protocol={wanted}, and {_CA_HINT}",
                        code="_SSL")
