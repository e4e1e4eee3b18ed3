"""Kafka-facing plumbing: client configuration, the topic plan, consumer-group lag, policy versions and trainer
runs on NS.control, ACLs, one deadline per call; the local broker in `rollstream.infra.broker`.

What users call is exported here, grouped by kind. The rest (client factories, the Kafka I/O both sides share,
the error mapping, threads) lives in the modules that define it, for rollstream's own packages.
"""

from rollstream.infra.acls import AclRule, apply_acls, plan_acls
from rollstream.infra.config import BOOTSTRAP_ENV, DEFAULT_TRAINER_GROUP, KafkaConfig
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.kafka_errors import KafkaIOError, MissingNamespaceError, UnreachableClusterError
from rollstream.infra.lag import GroupLag, LagReader, PartitionLag
from rollstream.infra.runs import GroupRun, PolicyAnnouncer, RunSupersededError, announce_policy_version
from rollstream.infra.topics import (
    TopicNames,
    TopicPlan,
    TopicSpec,
    alter_topics,
    create_topics,
    describe_topic_configs,
    existing_topics,
)

__all__ = [
    # configuration
    "BOOTSTRAP_ENV", "DEFAULT_TRAINER_GROUP", "KafkaConfig",
    # topics
    "TopicNames", "TopicPlan", "TopicSpec", "alter_topics", "create_topics", "describe_topic_configs",
    "existing_topics",
    # policy versions and trainer runs
    "GroupRun", "PolicyAnnouncer", "RunSupersededError", "announce_policy_version",
    # lag
    "GroupLag", "LagReader", "PartitionLag",
    # access control
    "AclRule", "apply_acls", "plan_acls",
    # deadlines
    "Deadline", "GRACE_S",
    # errors
    "KafkaIOError", "MissingNamespaceError", "UnreachableClusterError",
]
