"""The least-privilege ACLs of each rollstream role on a namespace, printed or applied.

Each rule was found by running that role against a broker with the StandardAuthorizer and
``allow.everyone.if.no.acl.found=false`` (pinned by ``tests/integration/test_security.py``):

- producer: Read, Describe on NS.prompts and Read on its intake group (join, commit, fetch committed
  offsets); Write, Describe and DescribeConfigs on NS.rollouts (publish; read ``max.message.bytes``);
  IdempotentWrite on the cluster (the idempotent producer's id); Read, Describe on NS.control (policy
  versions); Describe on the trainer's group: the lag gate reads its committed offsets (OffsetFetch needs
  Describe on the group), which does not allow committing for it (OffsetCommit needs Read).
- trainer: Read, Describe and DescribeConfigs on NS.rollouts; Read on its own group (commit, committed
  offsets); Write, Read, Describe on NS.steps (manifests; read back by the consumer at start, audit,
  replay); Write, Read, Describe on NS.control (announce policy versions); IdempotentWrite on the cluster;
  Write, Describe on the transactional id ``rollstream.NS.trainer-run`` (a trainer run's announcements and
  commits are transactions, which fence older runs: `rollstream.infra.runs`) and on
  ``rollstream.NS.group-run.GROUP`` (a consumer of the group fences its older consumers at start, and commits
  in that id's transactions when it announces nothing: `rollstream.infra.runs.GroupRun`);
  Write, Read, Describe on NS.prompts (requeue the prompt of a stale or retriably failed group; `status`
  and the epoch audit read the prompts) and Describe on the producers' intake group (`status`: its members
  and committed offsets).

Internal readers (manifests, replay, audit, lag, the control watcher) assign partitions and never commit,
so the broker never checks a group ACL for them; where one reads committed offsets it uses the trainer's
own group. No role needs a group other than the ones above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AclBinding,
    AclOperation,
    AclPermissionType,
    ResourcePatternType,
    ResourceType,
)
from rollstream.infra.clients import open_admin
from rollstream.infra.config import DEFAULT_TRAINER_GROUP, KafkaConfig
from rollstream.infra.kafka_errors import KafkaIOError, kafka_error
from rollstream.infra.runs import group_run_transactional_id, run_transactional_id
from rollstream.infra.topics import TopicNames
from rollstream.schemas import ConfigError

Role = Literal["producer", "trainer"]
Resource = Literal["TOPIC", "GROUP", "CLUSTER", "TRANSACTIONAL_ID"]
CLUSTER_NAME = "kafka-cluster"  # the one name of the cluster resource
# librdkafka calls Kafka's CLUSTER resource type BROKER (both are type 4 on the wire).
_RESOURCE_TYPES = {"TOPIC": ResourceType.TOPIC, "GROUP": ResourceType.GROUP, "CLUSTER": ResourceType.BROKER,
                   "TRANSACTIONAL_ID": ResourceType.TRANSACTIONAL_ID}


@dataclass(frozen=True)
class AclRule:
    """Allow ``principal`` (``User:name``) ``operation`` on one resource, from any host (a literal name)."""

    role: Role
    principal: str
    resource: Resource
    name: str
    operation: str  # an AclOperation name: READ, WRITE, DESCRIBE, DESCRIBE_CONFIGS, IDEMPOTENT_WRITE
    why: str

    def binding(self) -> AclBinding:
        return AclBinding(_RESOURCE_TYPES[self.resource], self.name, ResourcePatternType.LITERAL,
                          self.principal, "*", getattr(AclOperation, self.operation), AclPermissionType.ALLOW)

    def __str__(self) -> str:
        return f"{self.principal:<20} {self.operation:<17} {self.resource:<7} {self.name:<32} # {self.why}"


def principal(name: str) -> str:
    """``User:name`` for a bare ``name``; a ``Type:name`` principal as it is.

    Raises:
        ConfigError: empty, or a name after the colon is missing.
    """
    text = name.strip()
    if not text or text.endswith(":") or text.startswith(":"):
        raise ConfigError(f"principal {name!r}: give a user name (producer) or a principal (User:producer)")
    return text if ":" in text else f"User:{text}"


def plan_acls(namespace: str, producer_principal: str, trainer_principal: str, *,
              trainer_group: str = DEFAULT_TRAINER_GROUP, intake_group: str | None = None) -> list[AclRule]:
    """The rules each role needs on ``namespace`` (see the module docstring). Pure: no I/O.

    Raises:
        ConfigError: a principal or the namespace is not valid.
    """
    names = TopicNames(namespace)
    p, t = principal(producer_principal), principal(trainer_principal)
    intake = intake_group or names.producer_group
    spec: list[tuple[Role, str, Resource, str, tuple[str, ...], str]] = [
        ("producer", p, "TOPIC", names.prompts, ("READ", "DESCRIBE"), "take prompts"),
        ("producer", p, "GROUP", intake, ("READ",), "the producers' intake group: join, commit"),
        ("producer", p, "TOPIC", names.rollouts, ("WRITE", "DESCRIBE", "DESCRIBE_CONFIGS"),
         "publish groups; read max.message.bytes"),
        ("producer", p, "CLUSTER", CLUSTER_NAME, ("IDEMPOTENT_WRITE",), "idempotent producer"),
        ("producer", p, "TOPIC", names.control, ("READ", "DESCRIBE"), "follow policy versions"),
        ("producer", p, "GROUP", trainer_group, ("DESCRIBE",), "lag gate: read the trainer's committed offsets"),
        ("trainer", t, "TOPIC", names.rollouts, ("READ", "DESCRIBE", "DESCRIBE_CONFIGS"),
         "take groups; read max.message.bytes"),
        ("trainer", t, "GROUP", trainer_group, ("READ",), "the trainer's group: commit, committed offsets"),
        ("trainer", t, "TOPIC", names.steps, ("WRITE", "READ", "DESCRIBE"), "write manifests; audit, replay"),
        ("trainer", t, "TOPIC", names.control, ("WRITE", "READ", "DESCRIBE"), "announce policy versions"),
        ("trainer", t, "CLUSTER", CLUSTER_NAME, ("IDEMPOTENT_WRITE",), "idempotent announcer"),
        ("trainer", t, "TRANSACTIONAL_ID", run_transactional_id(names), ("WRITE", "DESCRIBE"),
         "trainer runs: announce and commit in transactions that fence older runs"),
        ("trainer", t, "TRANSACTIONAL_ID", group_run_transactional_id(names, trainer_group), ("WRITE", "DESCRIBE"),
         "group runs: a new take/consumer of the group fences older ones"),
        ("trainer", t, "TOPIC", names.prompts, ("WRITE", "READ", "DESCRIBE"),
         "requeue prompts; status and the epoch audit read them"),
        ("trainer", t, "GROUP", intake, ("DESCRIBE",), "status: the producers' members and committed offsets"),
    ]
    return [AclRule(role, who, kind, name, op, why) for role, who, kind, name, ops, why in spec for op in ops]


def apply_acls(rules: Sequence[AclRule], config: KafkaConfig, *, timeout: float = 30.0) -> None:
    """Create every rule's ACL (idempotent: an existing one is left as it is). Blocks up to ``timeout`` s.

    Needs a principal allowed to alter ACLs (the SASL broker's ``admin``). Not thread-safe per call.

    Raises:
        KafkaIOError: the broker refused (``code`` CLUSTER_AUTHORIZATION_FAILED: not allowed to alter
            ACLs; SECURITY_DISABLED: the broker has no authorizer) or did not answer (retriable).
    """
    if not rules:
        return
    admin = open_admin(config.admin({"log_level": 0}))
    futures = admin.create_acls([rule.binding() for rule in rules], request_timeout=timeout)
    for binding, future in futures.items():
        try:
            future.result(timeout)
        except KafkaException as exc:
            error = kafka_error(f"cannot create ACL {binding}", exc)
            if error.code == "SECURITY_DISABLED":
                raise KafkaIOError(f"the broker at {config.bootstrap_servers} has no authorizer, so it takes no "
                                   "ACLs; start it with one (rollstream broker start --sasl)",
                                   code=error.code) from exc
            if error.code == "CLUSTER_AUTHORIZATION_FAILED":
                raise KafkaIOError(f"not authorized to create ACLs on {config.bootstrap_servers}: use a principal "
                                   "allowed to alter the cluster (the SASL broker's admin.properties) with "
                                   "--kafka-config", code=error.code) from exc
            raise error from exc
        except TimeoutError as exc:
            raise KafkaIOError(f"cannot create ACL {binding}: no answer from {config.bootstrap_servers} within "
                               f"{timeout:g} s; is the broker up (rollstream broker status)?",
                               code="_TIMED_OUT", retriable=True) from exc
