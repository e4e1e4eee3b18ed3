"""ScoredGroup schema v4, pinned without a broker: per-sample loss masks and version spans, per-group
sampling parameters; golden bytes; v3 records still decode; what decode must refuse."""

from __future__ import annotations

import io
import itertools
import json

import fastavro
import numpy as np
import pytest
from rollstream.schemas import (
    DecodeError,
    InvalidRecordError,
    Sample,
    Samples,
    Sampling,
    ScoredGroup,
    VersionSpan,
    decode,
    default_codec,
    encode,
    fingerprint,
)
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

from tests.records import MULTI_TURN_SAMPLING, make_group, make_multi_turn_group

GOLDEN_V4_HEX = (  # make_multi_turn_group() as schema v4 writes it
    "c301df2a40b840ad20ae066d2330026d00000008746573740204187573652074686520746f6f6c0002666666666666e6"
    "3fcdccccccccccec3f6410050000000200000020000000000000f03f0000000000000000040001040101100200000001"
    "000000300300000000000000040000000000000004000000000000000401001002000000000000006003000000000000"
    "0000000000000000000200000000000000040000000000000002000000000000000500000000000000100a0000000100"
    "00001661625b31332031345d636418010000000200000003000000380b0000000c0000000d0000000e0000000f000000"
    "150000001600000038000000bf000080be0000000000000000000080bf000000be000000c00a0101000001"
)
V3_SCHEMA = json.loads((SCHEMA_DIR / "history" / "scored_group.v3.avsc").read_text())
V4_ONLY = ("sampling", "has_loss_mask", "version_span_counts", "version_spans", "loss_masks")


def _datum(group: ScoredGroup) -> dict[str, object]:
    """The v4 datum `group` is written as (read back from its bytes by fastavro)."""
    return fastavro.schemaless_reader(io.BytesIO(encode(group)[10:]), default_codec().schema(ScoredGroup), None)


def _written(schema: dict, datum: dict[str, object]) -> bytes:
    """`datum` written as a single-object record of `schema` (fastavro, no rollstream code)."""
    parsed = fastavro.parse_schema(schema)
    body = io.BytesIO()
    fastavro.schemaless_writer(body, parsed, datum)
    return MAGIC + fingerprint(parsed) + body.getvalue()


def test_golden_bytes_pin_masks_spans_and_sampling() -> None:
    group = make_multi_turn_group()
    data = encode(group)  # written with the current schema (v5: v4's fields and the attempts)
    assert bytes.fromhex(GOLDEN_V4_HEX)[2:10].hex() == "df2a40b840ad20ae"  # fingerprint of scored_group.v4.avsc
    back = decode(bytes.fromhex(GOLDEN_V4_HEX), ScoredGroup)
    assert back == group and back.sampling == MULTI_TURN_SAMPLING
    first, second = back.samples
    assert first.loss_mask.tolist() == [1, 1, 0, 0, 1] and first.loss_mask.dtype == np.uint8
    assert first.version_spans == (VersionSpan(3, 0, 2), VersionSpan(4, 2, 5)) and first.weight_versions == (3, 4)
    assert first.token_versions().tolist() == [3, 3, 4, 4, 4] and first.weight_version == 3
    assert second.loss_mask is None and second.version_spans == () and second.token_versions().tolist() == [4, 4]
    assert encode(back) == data  # re-encoding the held columns gives the same bytes
    assert (back.attempt, back.max_attempts, back.retriable, back.source_prompt) == (0, 1, False, b"")


def test_v3_records_decode_with_no_mask_no_spans_and_no_sampling() -> None:
    group = make_group("old", rewards=(1.0, 0.0, 0.5), versions=(2, 3))
    v3_datum = {k: v for k, v in _datum(group).items() if k not in V4_ONLY}
    data = _written(V3_SCHEMA, v3_datum)
    assert data[2:10].hex() == "891d5c82662d289c"  # v3's fingerprint, unchanged since v3 was current
    back = decode(data, ScoredGroup)
    assert back == group and back.sampling is None and back.oldest_weight_version == 2
    assert all(s.loss_mask is None and s.version_spans == () and s.weight_versions == (2, 3) for s in back.samples)
    assert back.samples[0].token_versions().tolist() == [-1] * 4  # two versions, no spans: which token is unknown
    record = np.frombuffer(data, np.uint8)  # old records are read in place too
    assert all(np.shares_memory(s.tokens, record) and np.shares_memory(s.logprobs, record) for s in back.samples)


def test_masks_spans_and_sampling_of_every_shape_round_trip() -> None:
    rng = np.random.default_rng(11)
    for trial in range(40):
        samples = []
        for _ in range(int(rng.integers(0, 5))):
            n = int(rng.integers(0, 9))
            mask = rng.integers(0, 2, n) if rng.random() < 0.5 else None
            spans: tuple[VersionSpan, ...] = ()
            if n and rng.random() < 0.5:  # one to three spans, of consecutive versions from `trial`
                cuts = sorted({0, n, *(rng.integers(1, n, 2).tolist() if n > 1 else [])})
                spans = tuple(VersionSpan(trial + k, a, b) for k, (a, b) in enumerate(itertools.pairwise(cuts)))
            samples.append(Sample(tokens=rng.integers(0, 99, n), reward=float(rng.random()), loss_mask=mask,
                                  version_spans=spans, logprobs=None if rng.random() < 0.3 else -rng.random(n)))
        sampling = Sampling(float(rng.random()), 1.0, int(rng.integers(1, 9))) if rng.random() < 0.5 else None
        group = ScoredGroup(group_id=f"r{trial}#0", prompt_id=f"r{trial}", epoch=0, prompt_tokens=[1],
                            samples=samples, started_at_ms=0, finished_at_ms=1, sampling=sampling)
        back = decode(encode(group), ScoredGroup)
        assert back == group and back.sampling == sampling
        for original, decoded in zip(group.samples, back.samples, strict=True):
            assert decoded.version_spans == original.version_spans
            assert decoded.token_versions().tolist() == original.token_versions().tolist()
            assert (decoded.loss_mask is None) == (original.loss_mask is None)
        versions = [v for s in samples for v in s.weight_versions]
        assert back.oldest_weight_version == group.oldest_weight_version == min(versions, default=None)


def test_decoded_masks_are_lazy_views_of_the_record() -> None:
    data = encode(make_multi_turn_group())
    group = decode(data, ScoredGroup)
    assert group.samples.columns is not None  # no Sample built yet
    assert group.oldest_weight_version == 3  # from the columns: the oldest version of sample 0's spans
    assert np.shares_memory(group.samples[0].loss_mask, np.frombuffer(data, np.uint8))


def test_oldest_weight_version_counts_from_the_oldest_span() -> None:
    late = Sample(tokens=[1, 2, 3], version_spans=[{"version": 7, "start": 0, "end": 1}, VersionSpan(9, 1, 3)])
    assert late.weight_versions == (7, 9) and late.weight_version == 7
    samples = Samples([late, Sample(tokens=[4], weight_versions=(8,))])
    assert samples.oldest_weight_version == 7
    group = ScoredGroup(group_id="o#0", prompt_id="o", epoch=0, prompt_tokens=[], samples=samples, started_at_ms=0,
                        finished_at_ms=1)
    assert decode(encode(group), ScoredGroup).oldest_weight_version == 7


def test_equality_includes_masks_spans_and_sampling() -> None:
    base = make_multi_turn_group()
    s0 = base.samples[0]
    assert Sample(tokens=s0.tokens, logprobs=s0.logprobs, text=s0.text, reward=s0.reward, loss_mask=s0.loss_mask,
                  version_spans=s0.version_spans) == s0
    assert Sample(tokens=s0.tokens, logprobs=s0.logprobs, text=s0.text, reward=s0.reward,
                  version_spans=s0.version_spans) != s0  # no mask is not this mask
    assert Sample(tokens=s0.tokens, logprobs=s0.logprobs, text=s0.text, reward=s0.reward, loss_mask=[1, 1, 1, 0, 1],
                  version_spans=s0.version_spans) != s0
    assert Sample(tokens=s0.tokens, logprobs=s0.logprobs, text=s0.text, reward=s0.reward, loss_mask=s0.loss_mask,
                  version_spans=(VersionSpan(3, 0, 3), VersionSpan(4, 3, 5))) != s0
    assert make_multi_turn_group(sampling=Sampling(0.7, 0.9, 40)) != base
    assert make_multi_turn_group(sampling=None) != base and make_multi_turn_group() == base


def _spans(*triplets: int) -> bytes:
    return np.array(triplets, "<i8").tobytes()


@pytest.mark.parametrize("changes, words", [
    ({"has_loss_mask": b"\x01"}, "1 loss mask flags"),
    ({"has_loss_mask": b"\x02\x00"}, "bad loss mask flags"),
    ({"loss_masks": b"\x01\x01\x00\x00"}, "4 loss mask entries do not match the 5"),
    ({"loss_masks": b"\x01\x01\x00\x02\x01"}, "must be 0 or 1, found 2"),
    ({"version_span_counts": np.array([2], "<i4").tobytes()}, "4 bytes of version span counts"),
    ({"version_span_counts": np.array([1, 0], "<i4").tobytes()}, "6 version span numbers"),
    ({"version_spans": _spans(3, 0, 2, 4, 3, 5)}, "do not cover its 5 response tokens"),
    ({"version_spans": _spans(3, 0, 2, 4, 2, 4)}, "do not cover its 5 response tokens"),
    ({"version_spans": _spans(3, 0, 5, 4, 5, 5)}, "do not cover its 5 response tokens"),
    ({"version_spans": _spans(3, 1, 2, 4, 2, 5)}, "do not cover its 5 response tokens"),
    ({"version_spans": _spans(4, 0, 2, 3, 2, 5)}, r"name versions \(4, 3\), its weight versions are \(3, 4\)"),
    ({"version_spans": _spans(3, 0, 2)}, "3 version span numbers"),
    ({"sampling": {"temperature": 0.7, "top_p": 0.0, "top_k": 50}}, "top_p=0.0"),
    ({"sampling": {"temperature": -1.0, "top_p": 1.0, "top_k": -1}}, "temperature=-1.0"),
])
def test_v4_columns_that_disagree_are_decode_errors(changes: dict[str, object], words: str) -> None:
    data = _written(default_codec().schema(ScoredGroup), _datum(make_multi_turn_group()) | changes)
    with pytest.raises(DecodeError, match=words):
        decode(data, ScoredGroup)


def test_mutated_v4_records_decode_completely_or_raise_decode_error() -> None:
    """Masks and spans are built lazily too, so decode must have checked everything they need."""
    rng = np.random.default_rng(4)
    data = bytearray(encode(make_multi_turn_group()))
    for _ in range(600):
        mutated = bytearray(data)
        for at in rng.integers(10, len(data), rng.integers(1, 4)):
            mutated[at] = int(rng.integers(0, 256))
        try:
            group = decode(bytes(mutated), ScoredGroup)
        except DecodeError:
            continue
        for s in group.samples:  # building every sample and re-encoding must not fail now
            assert s.loss_mask is None or (len(s.loss_mask) == len(s.tokens) and s.loss_mask.max(initial=0) <= 1)
            assert sum(span.end - span.start for span in s.version_spans) in (0, len(s.tokens))
        assert decode(encode(group), ScoredGroup) == group


def test_sample_validation_names_the_field_and_the_lengths() -> None:
    with pytest.raises(InvalidRecordError, match="loss_mask has 2 entries for 3 tokens"):
        Sample(tokens=[1, 2, 3], loss_mask=[1, 0])
    with pytest.raises(InvalidRecordError, match="loss_mask"):
        Sample(tokens=[1, 2], loss_mask=[1, 2])
    with pytest.raises(InvalidRecordError, match="end at token 2, but the sample has 3 tokens"):
        Sample(tokens=[1, 2, 3], version_spans=(VersionSpan(1, 0, 2),))
    with pytest.raises(InvalidRecordError, match="starts at 1, expected 0"):
        Sample(tokens=[1, 2, 3], version_spans=(VersionSpan(1, 1, 3),))
    with pytest.raises(InvalidRecordError, match="top_p"):
        Sampling(top_p=1.5)
