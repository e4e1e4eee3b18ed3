"""Kafka-facing plumbing: client configuration, the topic plan, consumer-group lag, policy versions on
NS.control, the local broker."""

from infra._worker import WorkerThread
from infra.clients import open_admin, open_consumer, open_producer
from infra.config import BOOTSTRAP_ENV, DEFAULT_BOOTSTRAP, KafkaConfig, default_bootstrap
from infra.control import (
    VERSION_FILE,
    ControlWatcher,
    PolicyAnnouncer,
    announce_policy_version,
    read_weights_version,
    write_weights_version,
)
from infra.lag import GroupLag, LagReader, PartitionLag
from infra.topics import TopicNames, TopicPlan, TopicSpec, create_topics, describe_topic_configs, sized_to_topic

__all__ = [
    "BOOTSTRAP_ENV", "DEFAULT_BOOTSTRAP", "VERSION_FILE", "ControlWatcher", "GroupLag", "KafkaConfig",
    "LagReader", "PartitionLag", "PolicyAnnouncer", "TopicNames", "TopicPlan", "TopicSpec", "WorkerThread",
    "announce_policy_version", "create_topics", "default_bootstrap", "describe_topic_configs", "open_admin",
    "open_consumer", "open_producer", "sized_to_topic",
    "read_weights_version", "write_weights_version",
]
