"""Avro single-object encoding of rollstream records, with schema evolution.

Wire format (Avro specification, "Single object encoding"): the two marker bytes ``C3 01``, the
8-byte little-endian CRC-64-AVRO fingerprint of the writer schema's Parsing Canonical Form, then the
Avro binary body. A reader looks the fingerprint up among every schema this version knows (the
current ones in ``avro/`` and the older ones in ``avro/history/``). A record written with a current
schema is read with it; one written with an older schema is read with that older schema and handed to
its upgrader (`_upgrade`), which turns it into a datum of the current layout. So evolution lives in
one place, and what builds records from a datum (`_layout`) knows only the current layout.

Trailing ``bytes`` fields of a schema (ScoredGroup's packed token columns, of old versions too) are written
and read by the codec itself (a varint length, then the bytes), the fields before them are read with
fastavro and written by a writer compiled from the schema once (`rollstream.schemas._avro_writer`: the same bytes as
fastavro's, without its fixed cost per call). Encoding copies them once; decoding hands them to the layout as
memoryviews of the record's bytes, so decoded token arrays are views, not copies.

Pure: no Kafka, no torch, no I/O beyond reading the bundled ``.avsc`` files once. Thread-safe.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import fastavro
import numpy as np
from fastavro.schema import fingerprint as _avro_fingerprint
from fastavro.schema import to_parsing_canonical_form
from rollstream.schemas._avro_writer import Writer, compile_writer, write_long
from rollstream.schemas._errors import DecodeError, InvalidRecordError, SchemaError, UnknownSchemaError
from rollstream.schemas._layout import LAYOUTS
from rollstream.schemas._upgrade import UPGRADERS
from rollstream.schemas.inflight import InflightCheckpoint
from rollstream.schemas.records import PolicyVersion, Prompt, Record, ScoredGroup, StepManifest, TrainerPosition

MAGIC = b"\xc3\x01"
HEADER_SIZE = len(MAGIC) + 8
SCHEMA_DIR = Path(__file__).parent / "avro"
_FILES = {Prompt: "prompt.avsc", ScoredGroup: "scored_group.avsc",
          StepManifest: "step_manifest.avsc", PolicyVersion: "policy_version.avsc",
          TrainerPosition: "trainer_position.avsc", InflightCheckpoint: "inflight_checkpoint.avsc"}
Buffer = bytes | bytearray | memoryview | np.ndarray
R = TypeVar("R", Prompt, ScoredGroup, StepManifest, PolicyVersion, TrainerPosition, InflightCheckpoint)


def fingerprint(schema: dict[str, Any] | str) -> bytes:
    """The 8-byte CRC-64-AVRO fingerprint of a schema (little-endian, as single-object encoding writes it)."""
    parsed = fastavro.parse_schema(schema if not isinstance(schema, str) else json.loads(schema))
    return bytes.fromhex(_avro_fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


@dataclass(frozen=True)
class _WriterSchema:
    """A schema records may be written with, and how to read them.

    `upgrade`: for an older schema, its upgrader to the current layout (None for a current schema).
    `head`, `tail`: for a schema that ends in ``bytes`` fields, the leading part fastavro reads and
    the trailing fields the codec handles in place (None and () otherwise).
    """

    name: str
    parsed: dict[str, Any]
    path: Path
    upgrade: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    head: dict[str, Any] | None = None
    tail: tuple[str, ...] = ()


def _load(path: Path) -> dict[str, Any]:
    return _parse(json.loads(path.read_text()))


def _parse(schema: dict[str, Any]) -> dict[str, Any]:
    """A record schema, parsed for fastavro."""
    parsed = fastavro.parse_schema(schema)
    if not isinstance(parsed, dict):
        raise SchemaError(f"expected an Avro record schema, got {schema!r}")
    return parsed


def _read_datum(body: io.BytesIO, schema: dict[str, Any]) -> dict[str, Any]:
    """The datum of a record schema at the position of `body` (fastavro; a record reads as a dict)."""
    datum = fastavro.schemaless_reader(body, schema, None)
    if not isinstance(datum, dict):
        raise ValueError(f"a {schema['name']} body read as {type(datum).__name__}, not a record")
    return datum


class Codec:
    """Encodes records to single-object Avro bytes and decodes any known writer version back.

    Build one and share it: construction parses every bundled schema; encode/decode are thread-safe.
    """

    def __init__(self, schema_dir: Path = SCHEMA_DIR) -> None:
        self._schema_dir = schema_dir
        self._current: dict[type, dict[str, Any]] = {}
        self._header: dict[type, bytes] = {}
        self._class_by_name: dict[str, type] = {}
        self._writers: dict[bytes, _WriterSchema] = {}
        self._current_writer: dict[type, _WriterSchema] = {}
        self._write: dict[type, Writer] = {}  # the current schema's head (or whole record), compiled
        for cls, filename in _FILES.items():
            parsed = _load(schema_dir / filename)
            self._current[cls] = parsed
            self._header[cls] = MAGIC + fingerprint(parsed)
            self._class_by_name[parsed["name"]] = cls
            head, tail = _split_tail(json.loads((schema_dir / filename).read_text()))
            writer = _WriterSchema(parsed["name"], parsed, schema_dir / filename, head=head, tail=tail)
            self._write[cls] = compile_writer(head or parsed)
            self._writers[fingerprint(parsed)] = self._current_writer[cls] = writer
        for path in sorted(schema_dir.glob("history/*.avsc")):
            upgrade = UPGRADERS.get(path.name)
            if upgrade is None:
                raise SchemaError(f"old schema {path} has no upgrader: add one for {path.name!r} "
                                  "to schemas/_upgrade.py")
            parsed = _load(path)
            head, tail = _split_tail(json.loads(path.read_text()))  # old columns are read in place too
            self._writers.setdefault(fingerprint(parsed), _WriterSchema(parsed["name"], parsed, path,
                                                                        upgrade=upgrade, head=head, tail=tail))

    def schema(self, record_type: type[R]) -> dict[str, Any]:
        """The current (reader and writer) parsed schema of `record_type`."""
        return self._current[record_type]

    def fingerprints(self) -> dict[str, str]:
        """Every known writer fingerprint (hex) and the schema file it belongs to."""
        return {fp.hex(): str(w.path.relative_to(self._schema_dir)) for fp, w in self._writers.items()}

    def encode(self, record: Record) -> bytes:
        """Encode `record` with the current schema of its type.

        Raises:
            InvalidRecordError: the record does not fit its schema; the message names the field.
        """
        record_type = type(record)
        if record_type not in self._current:
            raise InvalidRecordError(f"cannot encode a {record_type.__name__}: not a rollstream record")
        writer = self._current_writer[record_type]
        datum = LAYOUTS[record_type].to_datum(record)
        out = bytearray(self._header[record_type])
        try:
            self._write[record_type](datum, out)
            tail = [_bytes_field(datum[name]) for name in writer.tail]
        except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
            raise InvalidRecordError(_explain_invalid(writer.parsed, datum, exc)) from exc
        if not tail:
            return bytes(out)
        # Any: numpy arrays are buffers, which numpy's stubs declare only for Python >= 3.12
        chunks: list[Any] = [out, *(part for field in tail for part in field)]
        try:
            return b"".join(chunks)
        except (TypeError, BufferError) as exc:  # a part that is no contiguous buffer (e.g. a strided array)
            raise InvalidRecordError(f"{writer.name} does not fit its schema: a bytes field of "
                                     f"{', '.join(writer.tail)} is not a contiguous buffer: {exc}") from exc

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
        try:
            if writer.head is None:
                datum = _read_datum(body, writer.parsed)
                end = body.tell()
            else:
                datum = _read_datum(body, writer.head)
                end = _read_tail(data, body.tell(), writer.tail, datum)
            if writer.upgrade is not None:
                datum = writer.upgrade(datum)
            record = LAYOUTS[record_type].from_datum(datum)
        except SchemaError as exc:
            raise DecodeError(f"corrupt {writer.name} record: {exc}", raw=data) from exc
        except (EOFError, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError,
                OverflowError, MemoryError, StopIteration) as exc:
            raise DecodeError(f"corrupt {writer.name} record: {type(exc).__name__}: {exc}",
                              raw=data) from exc
        if end != len(data):
            raise DecodeError(f"corrupt {writer.name} record: {len(data) - end} "
                              "trailing bytes after the body", raw=data)
        return record


def _split_tail(schema: dict[str, Any]) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """A record schema's leading fields (parsed, for fastavro) and the names of its trailing ``bytes`` fields."""
    fields = schema["fields"]
    split = len(fields)
    while split and fields[split - 1]["type"] == "bytes":
        split -= 1
    if split == len(fields):
        return None, ()
    head = _parse({**schema, "fields": fields[:split]})
    return head, tuple(f["name"] for f in fields[split:])


def _read_tail(data: bytes, pos: int, names: tuple[str, ...], datum: dict[str, Any]) -> int:
    """Read Avro ``bytes`` fields `names` from `data` at `pos` into `datum` as memoryviews; return the end.

    Avro encodes ``bytes`` as a zig-zag varint length and the bytes themselves.
    """
    view = memoryview(data)
    for name in names:
        size, pos = _read_long(data, pos)
        if size < 0 or pos + size > len(data):
            raise ValueError(f"field {name!r} claims {size} bytes at offset {pos}, the record has {len(data)}")
        datum[name] = view[pos:pos + size]
        pos += size
    return pos


def _bytes_field(value: Buffer | tuple[Buffer, ...]) -> tuple[Buffer, ...]:
    """An Avro ``bytes`` value as the parts to write: its zig-zag varint length, then the bytes, not
    copied. A record may give the value as a numpy array, bytes, or in parts (a tuple of them), written
    back to back. A part that is not a contiguous buffer fails when the record's bytes are joined."""
    parts = value if type(value) is tuple else (value,)
    size = 0
    for part in parts:
        kind = type(part)
        size += len(part) if kind is bytes or kind is bytearray else part.nbytes  # type: ignore[union-attr]
    length = bytearray()
    write_long(size, length)
    return (bytes(length), *parts)


def _read_long(data: bytes, pos: int) -> tuple[int, int]:
    """An Avro ``long`` (zig-zag varint) at `pos`: (value, position after it). IndexError when truncated."""
    byte = data[pos]
    raw, shift = byte & 0x7F, 7
    while byte & 0x80:
        if shift > 63:
            raise ValueError(f"varint longer than 10 bytes at offset {pos}")
        pos += 1
        byte = data[pos]
        raw |= (byte & 0x7F) << shift
        shift += 7
    return (raw >> 1) ^ -(raw & 1), pos + 1


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
