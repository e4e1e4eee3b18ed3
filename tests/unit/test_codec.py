"""The codec contract, pinned without a broker: round trip, evolution, golden bytes, bad bytes."""

from __future__ import annotations

import io
import json

import fastavro
import numpy as np
import pytest
from rollstream.schemas import (
    FINISH_REASONS,
    VERSION_FILE,
    Codec,
    DecodeError,
    InvalidRecordError,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    SchemaError,
    ScoredGroup,
    StepManifest,
    UnknownSchemaError,
    decode,
    default_codec,
    encode,
    fingerprint,
    make_group_id,
    read_policy_version,
    write_policy_version,
)
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

GOLDEN_HEX = (
    "c30106817c816b92a68d0a702d31233206702d310400000a6770752d3080a0abfef962d0afabfef96208312b313d040c"
    "736f757263650a67736d386b14646966666963756c747902330000000200000008030000001000000000000000000200"
    "020108020000002003000000000000000400000000000000020008000000000000000000080800000010616e73776572"
    "2030180700000008000000090000001800000000010000000200000018000080bf000000bf0000000000"
)
# The same group as written by schema v6 (no resume points: four empty columns fewer).
GOLDEN_V6_HEX = (
    "c3017a7d0236bb01d7ab0a702d31233206702d310400000a6770752d3080a0abfef962d0afabfef96208312b313d040c"
    "736f757263650a67736d386b14646966666963756c747902330000000200000008030000001000000000000000000200"
    "0201080200000020030000000000000004000000000000000200080000000000080800000010616e7377657220301807"
    "00000008000000090000001800000000010000000200000018000080bf000000bf0000000000"
)
# The same group as written by schema v5 (no trainer run).
GOLDEN_V5_HEX = (
    "c301aaae59d2e441c2b70a702d31233206702d310400000a6770752d3080a0abfef962d0afabfef96208312b313d040c"
    "736f757263650a67736d386b14646966666963756c747902330000000200000803000000100000000000000000020002"
    "01080200000020030000000000000004000000000000000200080000000000080800000010616e737765722030180700"
    "000008000000090000001800000000010000000200000018000080bf000000bf0000000000"
)
GOLDEN_V4_HEX = (
    "c301df2a40b840ad20ae0a702d31233206702d310400000a6770752d3080a0abfef962d0afabfef96208312b313d040c"
    "736f757263650a67736d386b14646966666963756c747902330000080300000010000000000000000002000201080200"
    "000020030000000000000004000000000000000200080000000000080800000010616e73776572203018070000000800"
    "0000090000001800000000010000000200000018000080bf000000bf0000000000"
)
# The same group as written by schema v3 (no loss masks, version spans or sampling parameters).
GOLDEN_V3_HEX = (
    "c301891d5c82662d289c0a702d31233206702d310400000a6770752d3080a0abfef962d0afabfef96208312b313d040c"
    "736f757263650a67736d386b14646966666963756c747902330008030000001000000000000000000200020108020000"
    "002003000000000000000400000000000000080800000010616e73776572203018070000000800000009000000180000"
    "0000010000000200000018000080bf000000bf00000000"
)
# The same group as written by schema v2 (one record per sample), before v3 stored samples as columns.
GOLDEN_V2_HEX = (
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
    assert data[2:10].hex() == "06817c816b92a68d"  # fingerprint of scored_group.avsc (v7)
    assert data.hex() == GOLDEN_HEX
    assert decode(bytes.fromhex(GOLDEN_HEX)) == decode(data)
    assert decode(bytes.fromhex(GOLDEN_V6_HEX), ScoredGroup) == group  # records of the previous versions decode
    assert decode(bytes.fromhex(GOLDEN_V5_HEX), ScoredGroup) == group
    assert decode(bytes.fromhex(GOLDEN_V4_HEX), ScoredGroup) == group
    assert decode(bytes.fromhex(GOLDEN_V3_HEX), ScoredGroup) == group
    assert decode(bytes.fromhex(GOLDEN_V2_HEX), ScoredGroup) == group
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


def test_mutated_records_decode_completely_or_raise_decode_error() -> None:
    """Samples are built from the columns lazily, so decode must have checked everything they need."""
    rng = np.random.default_rng(1)
    data = bytearray(encode(make_group(n_samples=3, n_tokens=4)))
    for _ in range(1000):
        mutated = bytearray(data)
        for at in rng.integers(10, len(data), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        try:
            group = decode(bytes(mutated), ScoredGroup)
        except DecodeError:
            continue
        for sample in group.samples:  # building every sample and re-encoding must not fail now
            assert len(sample.tokens) >= 0 and (sample.logprobs is None or len(sample.logprobs) == len(sample.tokens))
        decode(encode(group), ScoredGroup)


def _current_datum(record: ScoredGroup | StepManifest) -> dict[str, object]:
    """The datum `record` is written as with its current schema (read back from its bytes by fastavro)."""
    return fastavro.schemaless_reader(io.BytesIO(encode(record)[10:]), default_codec().schema(type(record)), None)


def _columns_datum(**changes: object) -> bytes:
    datum = _current_datum(make_group(n_samples=2, n_tokens=3)) | changes
    body = io.BytesIO()
    fastavro.schemaless_writer(body, default_codec().schema(ScoredGroup), datum)
    return MAGIC + fingerprint(default_codec().schema(ScoredGroup)) + body.getvalue()


@pytest.mark.parametrize("changes, words", [
    ({"response_lengths": np.array([3, 4], "<i4").tobytes()}, "do not match"),
    ({"response_lengths": np.array([-1, 7], "<i4").tobytes()}, "bad sample columns"),
    ({"finish_reasons": b"\x00\x07"}, "bad sample columns"),
    ({"text_lengths": np.array([8], "<i4").tobytes()}, "disagree"),
    ({"texts": "answer 0"}, "do not match"),
    ({"has_logprobs": b"\x01\x00"}, "logprobs do not match"),
    ({"rewards": b"\x00" * 7}, "multiple of 8"),
    ({"weight_version_counts": np.array([2, 3], "<i4").tobytes()}, "do not match"),
])
def test_columns_that_disagree_are_decode_errors(changes: dict[str, object], words: str) -> None:
    with pytest.raises(DecodeError, match=words):
        decode(_columns_datum(**changes), ScoredGroup)


def test_samples_of_every_shape_round_trip() -> None:
    samples = [Sample(tokens=[], reward=None, finish_reason="abort"),
               Sample(tokens=[1, 2], logprobs=[-0.5, -0.25], reward=float("nan"), weight_versions=(1, 2)),
               Sample(tokens=[3], text="é", reward=-1.5, finish_reason="length", weight_versions=(2,))]
    group = ScoredGroup(group_id="g#0", prompt_id="g", epoch=0, prompt_tokens=[9], samples=samples,
                        started_at_ms=0, finished_at_ms=1)
    back = decode(encode(group), ScoredGroup)
    assert back.rewards == group.rewards == [None, None, -1.5]  # a NaN reward is no reward
    assert back.oldest_weight_version == 1 and group.oldest_weight_version == 1
    assert [s.logprobs is None for s in back.samples] == [True, False, True]
    assert back.samples[1].logprobs.tolist() == [-0.5, -0.25] and back.samples[2].text == "é"
    assert [s.finish_reason for s in back.samples] == ["abort", "stop", "length"]
    assert [s.weight_versions for s in back.samples] == [(), (1, 2), (2,)]
    assert back.samples == samples and back == group
    assert np.shares_memory(back.samples[1].tokens, back.samples.response_tokens)  # views, not copies


def test_strided_arrays_are_encoded_by_value() -> None:
    tokens = np.arange(10, dtype="<i4")[::2]  # not contiguous: copied on construction, not written raw
    logprobs = np.linspace(-1, 0, 10, dtype="<f4")[1::2]
    group = ScoredGroup(group_id="s#0", prompt_id="s", epoch=0, prompt_tokens=np.arange(6, dtype="<i4")[::3],
                        samples=[Sample(tokens=tokens, logprobs=logprobs, reward=1.0)], started_at_ms=0,
                        finished_at_ms=1)
    back = decode(encode(group), ScoredGroup)
    assert back.samples[0].tokens.tolist() == [0, 2, 4, 6, 8] and back.prompt_tokens.tolist() == [0, 3]
    np.testing.assert_array_equal(back.samples[0].logprobs, logprobs)


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


def _manifest() -> StepManifest:
    return StepManifest(step=3, consumer_group="g", topic="ns.rollouts", ranges=[PartitionRange(0, 10, 14)],
                        dispositions=[OffsetDisposition(0, 10, "taken", "a#0"),
                                      OffsetDisposition(0, 11, "filtered", "bé#1", "all_rewards_equal"),
                                      OffsetDisposition(0, 12, "undecodable", None, "not a rollstream record"),
                                      OffsetDisposition(0, 13, "duplicate", "", "group_id already taken")],
                        created_at_ms=5, policy_version=None)


def test_manifest_written_with_schema_v1_decodes_with_the_current_schema() -> None:
    manifest = _manifest()
    v1 = json.loads((SCHEMA_DIR / "history" / "step_manifest.v1.avsc").read_text())
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), {
        "step": 3, "consumer_group": "g", "topic": "ns.rollouts", "created_at_ms": 5, "policy_version": None,
        "ranges": [{"partition": 0, "start": 10, "end": 14}],
        "dispositions": [{**vars(d), "kind": d.kind.upper()} for d in manifest.dispositions]})
    assert decode(MAGIC + fingerprint(v1) + body.getvalue(), StepManifest) == manifest
    assert decode(encode(manifest), StepManifest) == manifest  # and the columns of version 2 round trip


def test_policy_version_written_before_runs_decodes_as_run_zero() -> None:
    v1 = json.loads((SCHEMA_DIR / "history" / "policy_version.v1.avsc").read_text())
    body = io.BytesIO()
    fastavro.schemaless_writer(body, fastavro.parse_schema(v1), {
        "version": 60, "weights_path": "/ckpt/v60", "created_at_ms": 5, "metadata": {"step": "59"}})
    old = decode(MAGIC + fingerprint(v1) + body.getvalue(), PolicyVersion)
    assert old == PolicyVersion(60, "/ckpt/v60", 5, {"step": "59"}, run=0, run_id=None)
    current = PolicyVersion(51, "/ckpt/v51", 6, run=2, run_id="r2")
    assert decode(encode(current), PolicyVersion) == current


@pytest.mark.parametrize("changes, words", [
    ({"offsets": np.array([1, 2], "<i8").tobytes()}, "disagree"),
    ({"kinds": b"\x00\x01\x02\x09"}, "kind code"),
    ({"group_ids": "a#0"}, "characters"),
    ({"reasons": [{"index": 4, "reason": "x"}]}, "reason for disposition 4"),
])
def test_manifest_columns_that_disagree_are_decode_errors(changes: dict[str, object], words: str) -> None:
    schema = default_codec().schema(StepManifest)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema, _current_datum(_manifest()) | changes)
    with pytest.raises(DecodeError, match=words):
        decode(MAGIC + fingerprint(schema) + body.getvalue(), StepManifest)


def test_decoded_token_arrays_are_views_of_the_record_bytes() -> None:
    data = encode(make_group(n_samples=3, n_tokens=4))
    group = decode(data, ScoredGroup)
    assert group.samples.columns is not None  # held as columns: no Sample built yet
    record = np.frombuffer(data, np.uint8)
    assert np.shares_memory(group.samples.response_tokens, record)
    assert all(np.shares_memory(s.tokens, record) and np.shares_memory(s.logprobs, record) for s in group.samples)
    assert FINISH_REASONS == ("stop", "length", "abort")  # their codes on the wire: 0, 1, 2


def test_every_old_schema_needs_an_upgrader(tmp_path) -> None:
    (tmp_path / "history").mkdir()
    for path in [*SCHEMA_DIR.glob("*.avsc"), *SCHEMA_DIR.glob("history/*.avsc")]:
        (tmp_path / path.relative_to(SCHEMA_DIR)).write_text(path.read_text())
    assert Codec(tmp_path).fingerprints() == default_codec().fingerprints()
    (tmp_path / "history" / "scored_group.v0.avsc").write_text(
        (SCHEMA_DIR / "history" / "scored_group.v1.avsc").read_text().replace('"epoch"', '"era"'))
    with pytest.raises(SchemaError, match="scored_group.v0.avsc' to schemas/_upgrade.py"):
        Codec(tmp_path)


def test_policy_version_file_of_a_weights_directory(tmp_path) -> None:
    assert read_policy_version(tmp_path) is None
    assert write_policy_version(tmp_path, 7) == tmp_path / VERSION_FILE
    assert read_policy_version(tmp_path) == 7
    for content in ("not json", '{"version": "7"}', '{"version": true}', "[]"):
        (tmp_path / VERSION_FILE).write_text(content)
        assert read_policy_version(tmp_path) is None


def test_non_finite_logprobs_and_infinite_rewards_are_refused_where_samples_are_built() -> None:
    with pytest.raises(InvalidRecordError, match="1 of 2 logprobs are NaN or infinite"):
        Sample(tokens=[1, 2], logprobs=[-0.1, float("nan")])
    with pytest.raises(InvalidRecordError, match="2 of 2 logprobs"):
        Sample(tokens=[1, 2], logprobs=np.array([np.inf, -np.inf], dtype=np.float32))
    with pytest.raises(InvalidRecordError, match="reward inf is not a finite number"):
        Sample(tokens=[1], reward=float("inf"))
    assert Sample(tokens=[1], reward=float("nan")).reward is None  # NaN stays "no score", as on the wire
