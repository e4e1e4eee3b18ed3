"""The rollstream contract: Avro schemas, record dataclasses and a pure codec (no Kafka, no torch)."""

from schemas._errors import (
    ConfigError,
    DecodeError,
    InvalidRecordError,
    RollstreamError,
    SchemaError,
    UnknownSchemaError,
)
from schemas.codec import Codec, decode, default_codec, encode, fingerprint
from schemas.records import (
    ChatMessage,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    Samples,
    ScoredGroup,
    StepManifest,
    make_group_id,
    now_ms,
)

__all__ = [
    "ChatMessage", "Codec", "ConfigError", "DecodeError", "InvalidRecordError", "OffsetDisposition",
    "PartitionRange", "PolicyVersion", "Prompt", "RollstreamError", "Sample", "Samples", "SchemaError",
    "ScoredGroup", "StepManifest", "UnknownSchemaError", "decode", "default_codec", "encode",
    "fingerprint", "make_group_id", "now_ms",
]
