"""The rollstream contract: Avro schemas, record dataclasses and a pure codec (no Kafka, no torch)."""

from rollstream.schemas._errors import (
    ConfigError,
    DecodeError,
    InvalidRecordError,
    LifecycleError,
    RollstreamError,
    SchemaError,
    UnknownSchemaError,
)
from rollstream.schemas._packing import float32_array, int32_array
from rollstream.schemas._plain import packed_samples, plain_samples
from rollstream.schemas.codec import Codec, decode, default_codec, encode, fingerprint
from rollstream.schemas.inflight import InflightCheckpoint, checkpoint_key
from rollstream.schemas.policy_dir import VERSION_FILE, read_policy_version, write_policy_version
from rollstream.schemas.records import (
    DISPOSITION_KINDS,
    FINISH_REASONS,
    GREEDY_BELOW,
    PLUGIN_KEYS,
    ChatMessage,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    Samples,
    Sampling,
    ScoredGroup,
    StepManifest,
    TrainerPosition,
    VersionSpan,
    logprob_temperature,
    make_group_id,
    now_ms,
)

__all__ = [
    "DISPOSITION_KINDS", "FINISH_REASONS", "GREEDY_BELOW", "PLUGIN_KEYS", "VERSION_FILE", "ChatMessage", "Codec",
    "ConfigError", "DecodeError", "InflightCheckpoint", "LifecycleError",
    "InvalidRecordError", "OffsetDisposition", "PartitionRange", "PolicyVersion", "Prompt", "RollstreamError",
    "Sample", "Samples", "Sampling", "SchemaError", "ScoredGroup", "StepManifest", "TrainerPosition",
    "UnknownSchemaError", "VersionSpan", "checkpoint_key", "decode", "default_codec", "encode", "fingerprint",
    "float32_array", "int32_array", "logprob_temperature", "make_group_id", "now_ms", "packed_samples", "plain_samples",
    "read_policy_version", "write_policy_version",
]
