"""Schema versions of issue 12 (requeue): Prompt v2 (attempt), ScoredGroup v5 (attempt, max_attempts,
retriable, source_prompt), StepManifest v3 (the requeued kind, an attempt per disposition). Records of
the previous versions, written by fastavro alone, still decode, with the defaults of a first attempt."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import fastavro
import pytest
from rollstream.schemas import (
    DecodeError,
    InvalidRecordError,
    OffsetDisposition,
    PartitionRange,
    Prompt,
    ScoredGroup,
    StepManifest,
    decode,
    default_codec,
    encode,
    fingerprint,
)
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

from tests.records import make_group


def _old(name: str, datum: dict[str, object]) -> bytes:
    schema = fastavro.parse_schema(json.loads((SCHEMA_DIR / "history" / name).read_text()))
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, datum)
    return MAGIC + fingerprint(schema) + body.getvalue()


def test_prompt_attempt_round_trips_and_v1_prompts_are_first_attempts() -> None:
    prompt = Prompt(id="p", prompt="q", epoch=2, label="4", metadata={"a": "b"}, attempt=3)
    assert decode(encode(prompt), Prompt) == prompt
    assert prompt.to_dict()["attempt"] == 3
    old = decode(_old("prompt.v1.avsc", {"id": "p", "epoch": 2, "prompt": "q", "label": None, "metadata": {}}), Prompt)
    assert old == Prompt(id="p", prompt="q", epoch=2) and old.attempt == 0
    with pytest.raises(InvalidRecordError, match="attempt must be an integer >= 0"):
        Prompt(id="p", prompt="q", attempt=-1)


def test_group_attempt_fields_round_trip() -> None:
    source = encode(Prompt(id="p", prompt="q", attempt=1))
    group = replace(make_group("p"), attempt=1, max_attempts=4, retriable=True, source_prompt=source)
    back = decode(encode(group), ScoredGroup)
    assert back == group
    assert (back.attempt, back.max_attempts, back.retriable) == (1, 4, True)
    assert decode(back.source_prompt, Prompt).attempt == 1
    with pytest.raises(InvalidRecordError, match="max_attempts 0 >= 1"):
        replace(make_group("p"), max_attempts=0)


def test_manifest_records_requeued_dispositions_with_their_attempts() -> None:
    dispositions = (OffsetDisposition(0, 10, "requeued", "a#0", "stale: 2 versions behind (max 1)", attempt=1),
                    OffsetDisposition(0, 11, "taken", "b#0"),
                    OffsetDisposition(0, 12, "filtered", "c#0", "stale: x (attempt 3 of 3: the last)", attempt=2))
    manifest = StepManifest(step=1, consumer_group="g", topic="t", ranges=(PartitionRange(0, 10, 13),),
                            dispositions=dispositions, created_at_ms=5)
    assert decode(encode(manifest), StepManifest) == manifest
    plain = replace(manifest, dispositions=(OffsetDisposition(0, 10, "taken", "a#0"),),
                    ranges=(PartitionRange(0, 10, 11),))
    datum = fastavro.schemaless_reader(io.BytesIO(encode(plain)[10:]), default_codec().schema(StepManifest), None)
    assert datum["attempts"] == b""  # first attempts only: the column stays empty


def test_v2_manifests_decode_with_attempt_zero_and_bad_attempts_are_refused() -> None:
    datum = {"step": 3, "consumer_group": "g", "topic": "t", "created_at_ms": 1, "policy_version": None,
             "ranges": [{"partition": 0, "start": 0, "end": 1}], "partitions": (0).to_bytes(4, "little"),
             "offsets": (0).to_bytes(8, "little"), "kinds": b"\x01", "group_id_lengths": (3).to_bytes(4, "little"),
             "group_ids": "a#0", "reasons": [{"index": 0, "reason": "all_rewards_equal"}]}
    old = decode(_old("step_manifest.v2.avsc", datum), StepManifest)
    assert old.dispositions == (OffsetDisposition(0, 0, "filtered", "a#0", "all_rewards_equal"),)
    assert old.dispositions[0].attempt == 0
    manifest = StepManifest(step=1, consumer_group="g", topic="t", ranges=(PartitionRange(0, 0, 1),),
                            dispositions=(OffsetDisposition(0, 0, "requeued", "a#0", "stale", attempt=1),))
    bad = bytearray(encode(manifest))
    bad[-4:] = (-1).to_bytes(4, "little", signed=True)  # the attempts column is last: its one int32
    with pytest.raises(DecodeError, match="attempts"):
        decode(bytes(bad), StepManifest)
    with pytest.raises(InvalidRecordError, match="attempt -1 must be >= 0"):  # as the constructor refuses it
        OffsetDisposition(0, 0, "requeued", "a#0", "stale", attempt=-1)
