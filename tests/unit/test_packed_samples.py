"""`rollstream.schemas.packed_samples`: responses whose tokens (logprobs, loss masks) are already one array, back
to back, as samples without a `Sample` per response (verl's rollouter publishes each of its samples so).

Pinned: the columns encode to exactly the bytes `Sample` objects of the same values encode (so the wire cannot
tell) and read back as those samples; a NaN reward is None, as there; what `Sample` refuses (a token id beyond
int32, a loss mask entry other than 0 or 1, a non-finite logprob, sizes that disagree) raises.
"""

from __future__ import annotations

import numpy as np
import pytest
from rollstream.schemas import (
    InvalidRecordError,
    Sample,
    Samples,
    ScoredGroup,
    decode,
    encode,
    make_group_id,
    packed_samples,
)


def _group(samples: Samples) -> ScoredGroup:
    return ScoredGroup(group_id=make_group_id("p", 0), prompt_id="p", epoch=0, prompt_tokens=[1, 2, 3],
                       samples=samples, started_at_ms=1, finished_at_ms=2, producer_id="t")


LENGTHS = [5, 0, 3]


def _arrays() -> dict:
    rng = np.random.default_rng(0)
    total = sum(LENGTHS)
    return {"tokens": rng.integers(0, 150_000, total), "logprobs": -rng.random(total),  # int64, float64: converted
            "loss_masks": (rng.random(total) > 0.3).astype(np.uint8)}


def _rows(arrays: dict, *, logprobs: bool, masks: bool) -> list[Sample]:
    out, at = [], 0
    for i, n in enumerate(LENGTHS):
        out.append(Sample(tokens=arrays["tokens"][at:at + n], logprobs=arrays["logprobs"][at:at + n] if logprobs
                          else None, reward=[1.0, None, float("nan")][i], finish_reason=["stop", "length", "abort"][i],
                          weight_versions=[(3,), (), (3, 4)][i], loss_mask=arrays["loss_masks"][at:at + n] if masks
                          else None))
        at += n
    return out


def _packed(arrays: dict, *, logprobs: bool, masks: bool) -> Samples:
    return packed_samples(arrays["tokens"], LENGTHS, logprobs=arrays["logprobs"] if logprobs else None,
                          loss_masks=arrays["loss_masks"] if masks else None, rewards=[1.0, None, float("nan")],
                          finish_reasons=["stop", "length", "abort"], weight_versions=[(3,), (), (3, 4)])


@pytest.mark.parametrize(("logprobs", "masks"), [(True, True), (False, True), (True, False), (False, False)])
def test_packed_columns_encode_exactly_as_samples_do(logprobs: bool, masks: bool) -> None:
    arrays = _arrays()
    packed, rows = _packed(arrays, logprobs=logprobs, masks=masks), _rows(arrays, logprobs=logprobs, masks=masks)
    assert encode(_group(packed)) == encode(_group(Samples(rows)))
    assert packed == rows and decode(encode(_group(packed)), ScoredGroup).samples == rows
    assert packed.rewards == [1.0, None, None]


def test_what_a_sample_refuses_raises() -> None:
    arrays = _arrays()
    with pytest.raises(InvalidRecordError, match="tokens"):
        packed_samples(np.array([2**31, 1, 2]), [3], logprobs=None, loss_masks=None, rewards=[None],
                       finish_reasons=["stop"], weight_versions=[()])
    with pytest.raises(InvalidRecordError, match="loss_mask"):
        packed_samples(arrays["tokens"], LENGTHS, logprobs=None, loss_masks=np.full(sum(LENGTHS), 2),
                       rewards=[None] * 3, finish_reasons=["stop"] * 3, weight_versions=[()] * 3)
    with pytest.raises(InvalidRecordError, match="NaN or infinite"):
        packed_samples(arrays["tokens"], LENGTHS, logprobs=np.full(sum(LENGTHS), np.nan), loss_masks=None,
                       rewards=[None] * 3, finish_reasons=["stop"] * 3, weight_versions=[()] * 3)
    with pytest.raises(InvalidRecordError, match="do not match"):
        packed_samples(arrays["tokens"], [5, 0, 2], logprobs=None, loss_masks=None, rewards=[None] * 3,
                       finish_reasons=["stop"] * 3, weight_versions=[()] * 3)
    with pytest.raises(InvalidRecordError, match="finish_reason"):
        packed_samples(arrays["tokens"], LENGTHS, logprobs=None, loss_masks=None, rewards=[None] * 3,
                       finish_reasons=["stop", "eos", "stop"], weight_versions=[()] * 3)
