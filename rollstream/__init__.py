"""rollstream: Kafka-based streaming rollouts for LLM reinforcement learning.

One import namespace. The libraries install as `rollstream.schemas` (the records and the codec),
`rollstream.infra` (Kafka plumbing), `rollstream.producers` (the generating side) and
`rollstream.consumers` (the trainer side); the repository keeps them as top-level folders, mapped here at
install time. This module is the public surface:

    from rollstream import RolloutConsumer, RolloutProducer, PolicyAnnouncer, PolicyVersion, KafkaConfig

The names below are loaded on first use (PEP 562), so ``import rollstream.schemas`` stays free of Kafka
and torch, and ``import rollstream`` costs nothing until a name is asked for. The CLI (`rollstream.cli`)
and the demo (`rollstream.demo`) are the composition root; no library module imports this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollstream._lazy import lazy_attributes

__version__ = "0.1.0"

# the package that defines each public name (loaded on first use by __getattr__ below)
_EXPORTS: dict[str, tuple[str, ...]] = {
    "rollstream.consumers": (
        "Batch", "CommitError", "FilterContext", "FilterError", "GroupConflictError", "GroupFilter",
        "RolloutConsumer", "TakeTimeout", "TensorBatch", "audit", "audit_epochs", "default_filters",
        "replay_range", "replay_since", "replay_step", "status",
    ),
    "rollstream.producers": (
        "Engine", "EngineCapabilities", "EngineError", "ProducerSettings", "RewardError", "RolloutProducer",
        "build_tiny_model",
        "load_prompts",
    ),
    "rollstream.infra": (
        "KafkaConfig", "KafkaIOError", "PolicyAnnouncer", "RunSupersededError", "TopicNames", "TopicPlan",
        "announce_policy_version", "create_topics",
    ),
    "rollstream.schemas": (
        "ConfigError", "DecodeError", "LifecycleError", "PolicyVersion", "Prompt", "RollstreamError", "Sample",
        "SchemaError", "ScoredGroup", "StepManifest", "decode", "encode",
    ),
}
_PACKAGE_OF = {name: package for package, names in _EXPORTS.items() for name in names}

__all__ = [  # the same names as _EXPORTS (tests/unit/test_layout.py checks)
    "__version__",
    "Batch", "CommitError", "FilterContext", "FilterError", "GroupConflictError", "GroupFilter",
    "RolloutConsumer", "TakeTimeout", "TensorBatch", "audit", "audit_epochs", "default_filters",
    "replay_range", "replay_since", "replay_step", "status",
    "Engine", "EngineCapabilities", "EngineError", "ProducerSettings", "RewardError", "RolloutProducer",
    "build_tiny_model",
    "load_prompts",
    "KafkaConfig", "KafkaIOError", "PolicyAnnouncer", "RunSupersededError", "TopicNames", "TopicPlan",
    "announce_policy_version", "create_topics",
    "ConfigError", "DecodeError", "LifecycleError", "PolicyVersion", "Prompt", "RollstreamError", "Sample",
    "SchemaError", "ScoredGroup", "StepManifest", "decode", "encode",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads the same names
    from rollstream.consumers import (
        Batch,
        CommitError,
        FilterContext,
        FilterError,
        GroupConflictError,
        GroupFilter,
        RolloutConsumer,
        TakeTimeout,
        TensorBatch,
        audit,
        audit_epochs,
        default_filters,
        replay_range,
        replay_since,
        replay_step,
        status,
    )
    from rollstream.infra import (
        KafkaConfig,
        KafkaIOError,
        PolicyAnnouncer,
        RunSupersededError,
        TopicNames,
        TopicPlan,
        announce_policy_version,
        create_topics,
    )
    from rollstream.producers import (
        Engine,
        EngineCapabilities,
        EngineError,
        ProducerSettings,
        RewardError,
        RolloutProducer,
        build_tiny_model,
        load_prompts,
    )
    from rollstream.schemas import (
        ConfigError,
        DecodeError,
        LifecycleError,
        PolicyVersion,
        Prompt,
        RollstreamError,
        Sample,
        SchemaError,
        ScoredGroup,
        StepManifest,
        decode,
        encode,
    )

__getattr__, __dir__ = lazy_attributes("rollstream", _PACKAGE_OF, globals())
