"""Kafka-facing plumbing: client configuration, the topic plan, consumer-group lag, the local broker."""

from infra.config import BOOTSTRAP_ENV, DEFAULT_BOOTSTRAP, KafkaConfig, default_bootstrap
from infra.lag import GroupLag, LagReader, PartitionLag
from infra.topics import TopicNames, TopicPlan, TopicSpec, create_topics, describe_topic_configs

__all__ = [
    "BOOTSTRAP_ENV", "DEFAULT_BOOTSTRAP", "GroupLag", "KafkaConfig", "LagReader", "PartitionLag",
    "TopicNames", "TopicPlan", "TopicSpec", "create_topics", "default_bootstrap", "describe_topic_configs",
]
