"""Resume points (issue 38, ScoredGroup schema v7): where a sample's generation resumed from an in-flight
checkpoint, and whose. Pinned: they round trip through the codec and from an engine's `Completion` into the
record; records of every older version decode with none; a group without any costs four empty columns and
stays on the producer's plain path (`plain_samples`); invalid ones are refused, saying what is wrong."""

from __future__ import annotations

import io
import json
from typing import Any

import fastavro
import numpy as np
import pytest
from rollstream.producers._groups import Outcome, _samples
from rollstream.producers.engines.base import Completion, EngineError, Generation
from rollstream.schemas import (
    DecodeError,
    InvalidRecordError,
    Sample,
    ScoredGroup,
    decode,
    default_codec,
    encode,
    fingerprint,
)
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

from tests.records import make_group, make_resumed_group
from tests.unit.test_codec import GOLDEN_V2_HEX, GOLDEN_V3_HEX, GOLDEN_V4_HEX, GOLDEN_V5_HEX, GOLDEN_V6_HEX

_V7_FIELDS = ("resume_point_counts", "resume_points", "resumed_from_lengths", "resumed_from")
_RESUMED = [((2, 4), ("gpu-a", "节点-🛰")), ((), ()), ((0,), ("gpu-b",))]


def _datum(group: ScoredGroup) -> dict[str, Any]:
    """The datum `group` is written as (read back by fastavro alone)."""
    datum = fastavro.schemaless_reader(io.BytesIO(encode(group)[10:]), default_codec().schema(ScoredGroup), None)
    assert isinstance(datum, dict)
    return datum


def _written(datum: dict[str, Any], schema_file: str = "scored_group.avsc") -> bytes:
    schema = fastavro.parse_schema(json.loads((SCHEMA_DIR / schema_file).read_text()))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, datum)
    return MAGIC + fingerprint(schema) + body.getvalue()


def test_resumed_samples_round_trip() -> None:
    group = make_resumed_group()
    back = decode(encode(group), ScoredGroup)
    assert back == group
    assert [(s.resume_points, s.resumed_from) for s in back.samples] == _RESUMED
    assert list(back.samples.columns.resume_counts) == [2, 0, 1]
    datum = _datum(group)
    assert np.frombuffer(datum["resume_points"], "<i4").tolist() == [2, 4, 0]
    assert datum["resumed_from"] == "gpu-a节点-🛰gpu-b"  # lengths in code points: 5, 4, 5
    assert np.frombuffer(datum["resumed_from_lengths"], "<i4").tolist() == [5, 4, 5]
    assert Sample(tokens=[1, 2], resume_points=(1, 1), resumed_from=("a", "b")).resume_points == (1, 1)  # a repeat


def test_a_group_without_resume_points_costs_four_empty_columns() -> None:
    plain = make_group("p", versions=(3,))
    datum = _datum(plain)
    assert [datum[k] for k in _V7_FIELDS] == [b"", b"", b"", ""]
    as_v6 = _written({k: v for k, v in datum.items() if k not in _V7_FIELDS}, "history/scored_group.v6.avsc")
    assert len(encode(plain)) == len(as_v6) + 4  # one byte (an empty length) per column
    assert decode(encode(plain), ScoredGroup).samples.columns.resume_counts == ()


@pytest.mark.parametrize("hex_record", [GOLDEN_V2_HEX, GOLDEN_V3_HEX, GOLDEN_V4_HEX, GOLDEN_V5_HEX, GOLDEN_V6_HEX])
def test_records_of_older_versions_decode_without_resume_points(hex_record: str) -> None:
    group = decode(bytes.fromhex(hex_record), ScoredGroup)
    assert group.samples and all(s.resume_points == () and s.resumed_from == () for s in group.samples)
    assert group.samples.columns.resume_counts == ()
    assert decode(encode(group), ScoredGroup) == group  # and re-encoded as v7


def test_the_engines_resume_points_reach_the_record_and_plain_groups_stay_plain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import rollstream.producers._groups as groups

    calls: list[int] = []
    real = groups.plain_samples
    monkeypatch.setattr(groups, "plain_samples", lambda *a: calls.append(1) or real(*a))
    plain = [Completion(text="a", tokens=[1, 2, 3]), Completion(text="b", tokens=[4])]
    samples = _samples(Generation(plain), Outcome(rewards=[1.0, 0.0], versions=[5, 5]))
    assert calls == [1] and samples.columns.resume_counts == ()
    resumed = [Completion(text="a", tokens=[1, 2, 3], resume_points=[2], resumed_from=["gpu-a"]), plain[1]]
    samples = _samples(Generation(resumed), Outcome(rewards=[1.0, 0.0], versions=[5, 5]))
    assert calls == [1]  # a resumed completion takes the Sample path
    assert [(s.resume_points, s.resumed_from) for s in samples] == [((2,), ("gpu-a",)), ((), ())]
    assert resumed[0].to_dict()["resume_points"] == [2] and resumed[0].to_dict()["resumed_from"] == ["gpu-a"]
    assert plain[0].to_dict()["resume_points"] == [] == plain[0].to_dict()["resumed_from"]


@pytest.mark.parametrize("points, producers, words", [
    ((5,), ("a",), r"resume points \[5\] must be ascending token indices in 0..4 \(the response has 4 tokens\)"),
    ((-1,), ("a",), r"resume points \[-1\] must be ascending token indices in 0..4"),
    ((3, 1), ("a", "b"), r"resume points \[3, 1\] must be ascending"),
    ((1,), (), "1 resume points and 0 producer ids they resumed from do not match"),
    ((), ("a",), "0 resume points and 1 producer ids"),
    ((1.5,), ("a",), "resume_points must be integer token indices"),
    ((1,), (7,), r"resumed_from must be producer ids \(strings\)"),
])
def test_invalid_resume_points_are_refused(points: tuple, producers: tuple, words: str) -> None:
    with pytest.raises(InvalidRecordError, match=words):
        Sample(tokens=[1, 2, 3, 4], resume_points=points, resumed_from=producers)


@pytest.mark.parametrize("points, producers, words", [
    ([5], ["a"], r"resume points \[5\] must be ascending token indices in 0..4 \(the completion has 4 tokens\)"),
    ([2, 1], ["a", "b"], "must be ascending"),
    ([1], [], "1 resume points but 0 producer ids"),
    ([1.0], ["a"], "must be integer token indices"),
    ([1], [None], "must be producer ids"),
])
def test_engines_with_invalid_resume_points_are_refused(points: list, producers: list, words: str) -> None:
    with pytest.raises(EngineError, match=words):
        Completion(text="x", tokens=[1, 2, 3, 4], resume_points=points, resumed_from=producers)


@pytest.mark.parametrize("changes, words", [
    ({"resume_point_counts": np.array([1, 0], "<i4").tobytes()}, "do not match the resume point counts"),
    ({"resume_point_counts": np.array([1], "<i4").tobytes()}, r"resume point counts \[1\] of 3 samples"),
    ({"resumed_from_lengths": np.array([5, 4, 9], "<i4").tobytes()}, "resumed_from is 14 characters"),
    ({"resume_points": np.array([2, 4, 4], "<i4").tobytes()}, r"sample 2: resume points \[4\] must be ascending"),
    ({"resume_points": np.array([4, 2, 0], "<i4").tobytes()}, r"sample 0: resume points \[4, 2\]"),
    ({"resume_point_counts": b"", "resume_points": b""}, "0 resume points and 3 producer ids"),
])
def test_resume_columns_that_disagree_are_decode_errors(changes: dict[str, object], words: str) -> None:
    with pytest.raises(DecodeError, match=words):
        decode(_written(_datum(make_resumed_group()) | changes), ScoredGroup)
