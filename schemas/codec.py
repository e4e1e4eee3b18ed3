"""Avro single-object encoding of rollstream records, with schema evolution.

Wire format (Avro specification, "Single object encoding"): the two marker bytes ``C3 01``, the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form, then the
Avro binary body. A reader looks the fingerprint up among every schema this version knows (the
current ones in ``avro/`` and the older ones in ``avro/history/``) and resolves the writer schema
to the current reader schema of the same record name, so records written by older producers decode.

Pure: no Kafka, no torch, no I/O beyond reading the bundled ``.avsc`` files once. Thread-safe.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fastavro
from fastavro.schema import fingerprint as _avro_fingerprint
from fastavro.schema import to_parsing_canonical_form

from schemas._errors import DecodeError, InvalidRecordError, SchemaError, UnknownSchemaError
from schemas.records import PolicyVersion, Prompt, Record, ScoredGroup, StepManifest

MAGIC = b"\xc3\x01"
HEADER_SIZE = len(MAGIC) + 8
SCHEMA_DIR = Path(__file__).parent / "avro"
_FILES = {Prompt: "prompt.avsc", ScoredGroup: "scored_group.avsc",
          StepManifest: "step_manifest.avsc", PolicyVersion: "policy_version.avsc"}
R = TypeVar("R", Prompt, ScoredGroup, StepManifest, PolicyVersion)


def fingerprint(schema: dict[str, Any] | str) -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of a schema (little-endian, as single-object encoding writes it)."""
    parsed = fastavro.parse_schema(schema if not isinstance(schema, str) else json.loads(schema))
    return bytes.fromhex(_avro_fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


@dataclass(frozen=True)
class _WriterSchema:
    name: str
    parsed: dict[str, Any]
    path: Path


def _load(path: Path) -> dict[str, Any]:
    return fastavro.parse_schema(json.loads(path.read_text()))


class Codec:
    """Encodes records to single-object Avro bytes and decodes any known writer version back.

    Build one and share it: construction parses every bundled schema; encode/decode are thread-safe.
    """

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        self._current: dict[type, dict[str, Any]] = {}
        self._header: dict[type, bytes] = {}
        self._class_by_name: dict[str, type] = {}
        self._writers: dict[bytes, _WriterSchema] = {}
        for cls, filename in _FILES.items():
            parsed = _load(schema_dir / filename)
            self._current[cls] = parsed
            self._header[cls] = MAGIC + fingerprint(parsed)
            self._class_by_name[parsed["name"]] = cls
        for path in sorted(schema_dir.glob("*.avsc")) + sorted(schema_dir.glob("history/*.avsc")):
            parsed = _load(path)
            self._writers[fingerprint(parsed)] = _WriterSchema(parsed["name"], parsed, path)

    def schema(self, record_type: type[R]) -> dict[str, Any]:
        """The current (reader and writer) parsed schema of `record_type`."""
        return self._current[record_type]

    def fingerprints(self) -> dict[str, str]:
        """Every known writer fingerprint (hex) and the schema file it belongs to."""
        return {fp.hex(): str(w.path.relative_to(SCHEMA_DIR)) for fp, w in self._writers.items()}

    def encode(self, record: Record) -> bytes:
        """Encode `record` with the current schema of its type.

        Raises:
            InvalidRecordError: the record does not fit its schema; the message names the field.
        """
        record_type = type(record)
        if record_type not in self._current:
            raise InvalidRecordError(f"cannot encode a {record_type.__name__}: not a rollstream record")
        schema = self._current[record_type]
        datum = record.to_avro()
        out = io.BytesIO()
        out.write(self._header[record_type])
        try:
            fastavro.schemaless_writer(out, schema, datum)
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise InvalidRecordError(_explain_invalid(schema, datum, exc)) from exc
        return out.getvalue()

    def decode(self, data: bytes, expected: type[R] | None = None) -> R:
        """Decode single-object Avro bytes into a record (of type `expected`, if given).

        Raises:
            DecodeError: not single-object Avro, truncated or corrupt body, or not of type `expected`.
            UnknownSchemaError: the fingerprint names no schema this version knows (a newer producer?).
        """
        data = bytes(data)  # no copy for bytes, which is what Kafka hands us
        if len(data) < HEADER_SIZE or data[:2] != MAGIC:
            raise DecodeError(
                f"not a rollstream record: expected Avro single-object marker c301, got "
                f"{data[:HEADER_SIZE].hex() or 'no bytes'} ({len(data)} bytes)", raw=data)
        writer = self._writers.get(data[2:HEADER_SIZE])
        if writer is None:
            raise UnknownSchemaError(
                f"unknown schema fingerprint {data[2:HEADER_SIZE].hex()}: written by a newer or "
                "foreign producer? Upgrade rollstream on this side, or check what writes to this topic",
                raw=data)
        record_type = self._class_by_name[writer.name]
        if expected is not None and record_type is not expected:
            raise DecodeError(f"expected a {expected.__name__} record, got a {writer.name}", raw=data)
        return self._read(data, writer, record_type)

    def _read(self, data: bytes, writer: _WriterSchema, record_type: type) -> Any:
        body = io.BytesIO(data)  # shares the bytes object: no copy
        body.seek(HEADER_SIZE)
        reader = self._current[record_type]
        try:
            datum = fastavro.schemaless_reader(body, writer.parsed, None if writer.parsed is reader else reader)
            record = record_type.from_avro(datum)
        except SchemaError as exc:
            raise DecodeError(f"corrupt {writer.name} record: {exc}", raw=data) from exc
        except (EOFError, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError,
                OverflowError, MemoryError, StopIteration) as exc:
            raise DecodeError(f"corrupt {writer.name} record: {type(exc).__name__}: {exc}",
                              raw=data) from exc
        if body.tell() != len(data):
            raise DecodeError(f"corrupt {writer.name} record: {len(data) - body.tell()} "
                              "trailing bytes after the body", raw=data)
        return record


def _explain_invalid(schema: dict[str, Any], datum: dict[str, Any], exc: Exception) -> str:
    from fastavro.validation import ValidationError, validate

    try:
        validate(datum, schema, raise_errors=True)
    except ValidationError as err:
        return f"{schema['name']} does not fit its schema: {err}"
    return f"{schema['name']} does not fit its schema: {type(exc).__name__}: {exc}"


@functools.cache
def default_codec() -> Codec:
    """The shared codec over the bundled schemas (built once; immutable afterwards)."""
    return Codec()


def encode(record: Record) -> bytes:
    """Encode with the shared codec. See `Codec.encode`."""
    return default_codec().encode(record)


def decode(data: bytes, expected: type[R] | None = None) -> R:
    """Decode with the shared codec. See `Codec.decode`."""
    return default_codec().decode(data, expected)
