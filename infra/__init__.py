"""Kafka-facing plumbing: client configuration, the topic plan, the Kafka I/O both sides share (one error
mapping), consumer-group lag, policy versions on NS.control, the local broker."""

from rollstream.infra._replaceable import ClientReplacement, close_quietly
from rollstream.infra.acls import AclRule, apply_acls, plan_acls
from rollstream.infra.clients import open_admin, open_consumer, open_producer
from rollstream.infra.config import (
    BOOTSTRAP_ENV,
    DEFAULT_BOOTSTRAP,
    DEFAULT_TRAINER_GROUP,
    KafkaConfig,
    default_bootstrap,
)
from rollstream.infra.control import ControlWatcher, position_key, publish_position
from rollstream.infra.kafka_errors import (
    CommitFailed,
    KafkaIOError,
    MissingNamespaceError,
    kafka_error,
    missing_namespace_error,
    missing_topic_error,
    not_authorized_error,
)
from rollstream.infra.kafka_io import (
    REACH_TIMEOUT_S,
    commit_offsets,
    committed_offsets,
    committed_with_metadata,
    is_record,
    partitions_of,
    position_of,
    produce_and_wait,
    read_assigned,
    read_ranges,
    reader,
    require_topics,
    watermarks,
)
from rollstream.infra.lag import GroupLag, LagReader, PartitionLag
from rollstream.infra.producer_state import ProducerState
from rollstream.infra.runs import PolicyAnnouncer, RunSupersededError, announce_policy_version
from rollstream.infra.threads import BoundedCaller, WorkerThread, call_within
from rollstream.infra.topics import (
    TopicNames,
    TopicPlan,
    TopicSpec,
    alter_topics,
    create_topics,
    describe_topic_configs,
    sized_to_topic,
)

__all__ = [
    "AclRule", "BOOTSTRAP_ENV", "BoundedCaller", "ClientReplacement", "CommitFailed", "ControlWatcher",
    "DEFAULT_BOOTSTRAP", "DEFAULT_TRAINER_GROUP",
    "GroupLag", "KafkaConfig", "KafkaIOError", "LagReader", "MissingNamespaceError",
    "PartitionLag", "PolicyAnnouncer", "ProducerState",
    "REACH_TIMEOUT_S", "RunSupersededError",
    "TopicNames", "TopicPlan", "TopicSpec", "WorkerThread", "alter_topics", "announce_policy_version", "apply_acls",
    "call_within",
    "close_quietly",
    "commit_offsets", "committed_offsets", "committed_with_metadata", "create_topics", "default_bootstrap",
    "describe_topic_configs", "is_record", "kafka_error", "missing_namespace_error", "missing_topic_error",
    "not_authorized_error", "open_admin",
    "open_consumer",
    "open_producer", "partitions_of", "plan_acls", "position_key", "position_of", "produce_and_wait",
    "publish_position", "read_assigned", "read_ranges", "reader",
    "require_topics", "sized_to_topic", "watermarks",
]
