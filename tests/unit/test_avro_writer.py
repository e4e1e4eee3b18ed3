"""The compiled Avro writer (`rollstream.schemas._avro_writer`) writes exactly fastavro's bytes, for every record type
the codec writes and for awkward values; a value that does not fit fails as fastavro's writer would, and
a schema it cannot write is refused when the codec is built."""

from __future__ import annotations

import io
import math
from typing import Any

import fastavro
import numpy as np
import pytest
from rollstream.schemas import (
    ChatMessage,
    InvalidRecordError,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    Sampling,
    SchemaError,
    ScoredGroup,
    StepManifest,
    TrainerPosition,
    VersionSpan,
    default_codec,
    encode,
    make_group_id,
)
from rollstream.schemas._avro_writer import compile_writer
from rollstream.schemas._layout import LAYOUTS
from rollstream.schemas.codec import HEADER_SIZE


def _fastavro_bytes(schema: dict[str, Any], datum: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return out.getvalue()


def _ours(schema: dict[str, Any], datum: Any) -> bytes:
    out = bytearray()
    compile_writer(fastavro.parse_schema(schema))(datum, out)
    return bytes(out)


def _group(**changes: Any) -> ScoredGroup:
    samples = [Sample(tokens=np.arange(300) + i, logprobs=-np.linspace(0, 3, 300), text=f"réponse {i} 🤖" * 20,
                      reward=None if i == 1 else float(i), finish_reason="length" if i else "stop",
                      weight_versions=(7,)) for i in range(3)]
    fields: dict[str, Any] = dict(
        group_id=make_group_id("p-ü", 3), prompt_id="p-ü", epoch=3, prompt="x" * 200, prompt_tokens=np.arange(70),
        samples=samples, producer_id="gpu-0", started_at_ms=1_700_000_000_000, finished_at_ms=-1,
        metadata={"k": "v" * 100, "ключ": "значение"}, sampling=Sampling(0.7, 0.95, 40), attempt=2, max_attempts=5,
        source_prompt=bytes(range(256)) * 3)
    return ScoredGroup(**{**fields, **changes})


RECORDS = [
    _group(),
    _group(status="failed", error="e" * 5000, sampling=None, metadata={}, samples=[], prompt_tokens=[]),
    _group(samples=[Sample(tokens=np.arange(5), loss_mask=np.array([1, 0, 1, 1, 0]),
                           version_spans=(VersionSpan(1, 0, 2), VersionSpan(2, 2, 5)))]),
    Prompt(id="p", prompt="2+2=", label="4", metadata={"a": "b"}),
    Prompt(id="p" * 300, prompt=(ChatMessage("system", "be brief"), ChatMessage("user", "hi " * 100)), epoch=9,
           attempt=2),
    StepManifest(step=12, consumer_group="trainer", topic="ns.rollouts",
                 ranges=(PartitionRange(0, 0, 100), PartitionRange(5, 2**40, 2**40 + 3)),
                 dispositions=tuple(OffsetDisposition(0, i, "taken", f"g{i}#0") for i in range(100))
                 + (OffsetDisposition(5, 2**40, "filtered", "x#1", reason="stale", attempt=1),),
                 policy_version=None),
    PolicyVersion(version=2**33, weights_path="/w/ü", metadata={"step": "3"}),
    PolicyVersion(version=0, weights_path=None),
    TrainerPosition(consumer_group="trainer", topic="ns.rollouts", step=4, committed={0: 10, 3: 2**40},
                    ends={0: 12, 3: 2**40 + 1}, observed_at_ms=1_700_000_000_000),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_encodes_to_fastavros_bytes(record: Any) -> None:
    codec = default_codec()
    schema = codec.schema(type(record))
    datum = LAYOUTS[type(record)].to_datum(record)
    if type(record) is ScoredGroup:  # the codec writes the packed tail itself; fastavro writes it as bytes
        datum = {k: (b"".join(bytes(memoryview(p)) for p in v) if isinstance(v, tuple) else
                     v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in datum.items()}
    assert encode(record)[HEADER_SIZE:] == _fastavro_bytes(schema, datum)


@pytest.mark.parametrize("value", [0, 1, -1, 63, 64, -64, -65, 127, 128, 8191, 8192, 2**31 - 1, -2**31, 2**53,
                                   2**63 - 1, -2**63])
def test_longs_and_ints_are_zigzag_varints_like_fastavros(value: int) -> None:
    schema = {"type": "record", "name": "L", "fields": [{"name": "l", "type": "long"},
                                                         {"name": "i", "type": "int"}]}
    datum = {"l": value, "i": max(-2**31, min(2**31 - 1, value))}
    assert _ours(schema, datum) == _fastavro_bytes(schema, datum)


def test_floats_strings_bytes_arrays_maps_and_unions_match_fastavro() -> None:
    schema = {"type": "record", "name": "All", "fields": [
        {"name": "f", "type": "float"}, {"name": "d", "type": "double"}, {"name": "b", "type": "boolean"},
        {"name": "s", "type": "string"}, {"name": "raw", "type": "bytes"},
        {"name": "e", "type": {"type": "enum", "name": "E", "symbols": ["A", "B", "C"]}},
        {"name": "a", "type": {"type": "array", "items": "long"}},
        {"name": "m", "type": {"type": "map", "values": ["null", "string"]}},
        {"name": "u", "type": ["string", {"type": "array", "items": "string"}]},
        {"name": "last_null", "type": ["double", "null"]}]}
    for datum in [
        {"f": 1.5, "d": math.pi, "b": True, "s": "", "raw": b"", "e": "C", "a": [], "m": {}, "u": "x",
         "last_null": None},
        {"f": -0.0, "d": math.inf, "b": False, "s": "é" * 100, "raw": bytes(200), "e": "A",
         "a": [1, -2, 2**40] * 30, "m": {"x": None, "y": "z" * 70}, "u": ["a", "b"], "last_null": 2.5},
    ]:
        assert _ours(schema, datum) == _fastavro_bytes(schema, datum)
    nan = _ours(schema, {**datum, "d": math.nan})
    assert math.isnan(fastavro.schemaless_reader(io.BytesIO(nan), fastavro.parse_schema(schema), None)["d"])


@pytest.mark.parametrize(("field", "value", "words"), [
    ("epoch", 2**31, "epoch"),
    ("prompt", 5, "prompt"),
    ("metadata", {"k": 1}, "metadata"),
    ("started_at_ms", 2**64, "started_at_ms"),
])
def test_values_that_do_not_fit_are_invalid_records_naming_the_field(field: str, value: Any, words: str) -> None:
    group = _group()
    object.__setattr__(group, field, value)  # past the record's own checks, as a bug would
    with pytest.raises(InvalidRecordError, match=words):
        encode(group)


def test_a_tail_part_that_is_no_contiguous_buffer_is_an_invalid_record() -> None:
    group = _group()
    object.__setattr__(group, "prompt_tokens", list(range(5)))  # not an array: no buffer
    with pytest.raises(InvalidRecordError, match="ScoredGroup"):
        encode(group)


@pytest.mark.parametrize("schema", [
    {"type": "record", "name": "F", "fields": [{"name": "x", "type": {"type": "fixed", "name": "X", "size": 4}}]},
    {"type": "record", "name": "U", "fields": [{"name": "x", "type": ["int", "long"]}]},
    {"type": "record", "name": "L",
     "fields": [{"name": "x", "type": {"type": "long", "logicalType": "timestamp-millis"}}]},
])
def test_schemas_it_cannot_write_are_refused_when_compiled(schema: dict[str, Any]) -> None:
    with pytest.raises(SchemaError, match="not supported"):
        compile_writer(fastavro.parse_schema(schema))
