"""The codec contract, pinned without a broker: round trip, evolution, golden bytes, bad bytes."""

from __future__ import annotations

import io
import json

import fastavro
import numpy as np
import pytest

from schemas import (
    DecodeError,
    InvalidRecordError,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    ScoredGroup,
    StepManifest,
    UnknownSchemaError,
    decode,
    default_codec,
    encode,
    fingerprint,
    make_group_id,
)
from schemas.codec import MAGIC, SCHEMA_DIR

GOLDEN_HEX = (
    "c301d4a272ac04d8de670a702d31233206702d310408312b313d18070000000800000009000000021800000000010000"
    "00020000000218000080bf000000bf0000000010616e7377657220300200000000000000000873746f7004060800000a"
    "6770752d3080a0abfef962d0afabfef9620000040c736f757263650a67736d386b14646966666963756c7479023300"
)


def make_group(n_samples: int = 2, n_tokens: int = 5) -> ScoredGroup:
    samples = [
        Sample(tokens=np.arange(n_tokens) + i, logprobs=np.linspace(-1, 0, n_tokens), text=f"answer {i}",
               reward=float(i), finish_reason="stop", weight_versions=(3, 4))
        for i in range(n_samples)
    ]
    return ScoredGroup(group_id=make_group_id("p-1", 2), prompt_id="p-1", epoch=2, prompt="1+1=",
                       prompt_tokens=[7, 8, 9], samples=samples, producer_id="gpu-0",
                       started_at_ms=1_700_000_000_000, finished_at_ms=1_700_000_001_000,
                       metadata={"source": "gsm8k", "difficulty": 3})


def test_scored_group_round_trip_keeps_every_field() -> None:
    group = make_group()
    back = decode(encode(group), ScoredGroup)
    assert back.group_id == "p-1#2" and back.prompt_id == "p-1" and back.epoch == 2
    assert back.prompt == "1+1=" and back.prompt_tokens.tolist() == [7, 8, 9]
    assert back.metadata == {"source": "gsm8k", "difficulty": "3"}
    for original, decoded in zip(group.samples, back.samples, strict=True):
        assert decoded.tokens.dtype == np.dtype("<i4")
        np.testing.assert_array_equal(decoded.tokens, original.tokens)
        np.testing.assert_array_equal(decoded.logprobs, original.logprobs)
        assert (decoded.text, decoded.reward, decoded.finish_reason) == (original.text, original.reward, "stop")
        assert decoded.weight_versions == (3, 4) and decoded.weight_version == 3


def test_failed_group_and_other_records_round_trip() -> None:
    failed = ScoredGroup(group_id="x#0", prompt_id="x", epoch=0, prompt_tokens=[], samples=(),
                         started_at_ms=1, finished_at_ms=2, status="failed", error="engine timed out")
    back = decode(encode(failed))
    assert back.status == "failed" and back.error == "engine timed out" and back.samples == ()
    prompt = Prompt(id="q", prompt=[{"role": "user", "content": "hi"}], epoch=1, label="42", metadata={"k": [1]})
    assert decode(encode(prompt), Prompt) == prompt
    manifest = StepManifest(step=4, consumer_group="g", topic="ns.rollouts",
                            ranges=[PartitionRange(0, 10, 12)],
                            dispositions=[OffsetDisposition(0, 10, "taken", "a#0"),
                                          OffsetDisposition(0, 11, "filtered", "b#0", "all rewards equal")],
                            created_at_ms=5, policy_version=2)
    assert decode(encode(manifest), StepManifest) == manifest
    version = PolicyVersion(version=7, weights_path="/w/7", created_at_ms=9, metadata={"step": "3"})
    assert decode(encode(version), PolicyVersion) == version


def test_large_group_packs_tokens_as_bytes() -> None:
    group = make_group(n_samples=8, n_tokens=4096)
    data = encode(group)
    # 8 x 4096 x (4 token + 4 logprob bytes) plus small overhead: packed, not varint arrays.
    assert 8 * 4096 * 8 < len(data) < 8 * 4096 * 8 + 2000
    assert decode(data).samples[7].tokens[-1] == 4095 + 7


def test_golden_bytes_pin_the_wire_format() -> None:
    """An accidental change of schema or encoding changes these bytes and fails here."""
    group = make_group(n_samples=1, n_tokens=3)
    data = encode(group)
    assert data[:2] == MAGIC
    assert data[2:10].hex() == "d4a272ac04d8de67"  # fingerprint of scored_group.avsc
    assert data.hex() == GOLDEN_HEX
    assert decode(bytes.fromhex(GOLDEN_HEX)) == decode(data)
    assert fingerprint('"int"').hex() == "8f5c393f1ad57572"  # the Avro spec's CRC-64-AVRO of "int"


def test_record_written_with_schema_v1_decodes_with_the_current_schema() -> None:
    v1 = json.loads((SCHEMA_DIR / "history" / "scored_group.v1.avsc").read_text())
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), {
        "group_id": "old#0", "prompt_id": "old", "epoch": 0,
        "prompt_tokens": np.array([1, 2], "<i4").tobytes(),
        "samples": [{"tokens": np.array([5, 6, 7], "<i4").tobytes(), "logprobs": None, "text": "x",
                     "reward": 1.0, "finish_reason": "length"}],
        "producer_id": "p", "started_at_ms": 1, "finished_at_ms": 2, "status": "OK", "error": None,
    })
    data = MAGIC + fingerprint(v1) + body.getvalue()
    group = decode(data, ScoredGroup)
    assert group.group_id == "old#0" and group.prompt == "" and group.metadata == {}
    assert group.samples[0].tokens.tolist() == [5, 6, 7] and group.samples[0].weight_versions == ()
    assert group.samples[0].finish_reason == "length" and group.samples[0].weight_version is None
    assert fingerprint(v1).hex() in default_codec().fingerprints()


@pytest.mark.parametrize("data, error, words", [
    (b"", DecodeError, "no bytes"),
    (b"garbage bytes here", DecodeError, "c301"),
    (MAGIC + b"\x00" * 8 + b"body", UnknownSchemaError, "unknown schema fingerprint"),
])
def test_bad_bytes_raise_typed_errors_with_the_raw_bytes(data: bytes, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as info:
        decode(data)
    assert info.value.raw == data and not info.value.retriable


def test_truncated_and_trailing_bodies_are_decode_errors() -> None:
    data = encode(make_group())
    with pytest.raises(DecodeError, match="corrupt"):
        decode(data[:-7])
    with pytest.raises(DecodeError, match="trailing"):
        decode(data + b"\x00")
    with pytest.raises(DecodeError, match="expected a Prompt"):
        decode(data, Prompt)


def test_random_garbage_never_escapes_as_anything_but_decode_error() -> None:
    rng = np.random.default_rng(0)
    header = encode(make_group())[:10]
    for _ in range(300):
        junk = header + rng.integers(0, 256, rng.integers(0, 64), dtype=np.uint8).tobytes()
        try:
            decode(junk)
        except DecodeError:
            pass


def test_invalid_records_name_the_field() -> None:
    with pytest.raises(InvalidRecordError, match="epoch"):
        encode(Prompt(id="a", prompt="b", epoch="one"))  # type: ignore[arg-type]
    with pytest.raises(InvalidRecordError, match="logprobs"):
        Sample(tokens=[1, 2], logprobs=[0.1])
    with pytest.raises(InvalidRecordError, match="finish_reason"):
        Sample(tokens=[1], finish_reason="eos")
    with pytest.raises(InvalidRecordError, match="tokens"):
        Sample(tokens=[1.5, 2.5])
    with pytest.raises(InvalidRecordError, match="int32"):
        Sample(tokens=[1, 2**40])  # would silently wrap to 0 if cast
    with pytest.raises(InvalidRecordError, match="needs an error"):
        ScoredGroup(group_id="g", prompt_id="p", epoch=0, prompt_tokens=[], samples=(),
                    started_at_ms=0, finished_at_ms=0, status="failed")
    with pytest.raises(InvalidRecordError, match="non-empty"):
        Prompt(id="", prompt="x")
