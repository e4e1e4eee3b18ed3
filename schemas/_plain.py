"""Samples built as a group's `SampleColumns` at once, without a `Sample` object per response:

- `plain_samples`: a producer's plain responses (no loss mask, no version spans, no resume points, one weight
  version each). The producer's hot path (`rollstream.producers._groups`).
- `packed_samples`: responses whose tokens (logprobs, loss masks) are already one array, back to back, as a
  trainer's padded batch gives them (`rollstream.consumers._verl_codec`: verl's rollouter publishes each sample).

Both check the group once (`check_columns`), as `Sample` checks each row; every other group is built from
`Sample` objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rollstream.schemas._errors import InvalidRecordError
from rollstream.schemas._packing import float32_array, int32_array
from rollstream.schemas._sample_checks import FINISH_CODES, finish_code
from rollstream.schemas._samples import SampleColumns, Samples, loss_mask_array


def plain_samples(tokens: Sequence[Sequence[int] | np.ndarray], logprobs: Sequence[Sequence[float] | np.ndarray | None],
                  texts: Sequence[str], rewards: Sequence[float | None], finish_reasons: Sequence[str],
                  versions: Sequence[int]) -> Samples | None:
    """The samples of plain responses (no loss mask, no version spans, no resume points, one weight version
    each) held as columns, without a `Sample` object per response: what a producer publishes most, checked as every
    group is (`check_columns`), once per group. None when a response breaks an invariant (a logprob
    count that differs from its tokens, a non-finite logprob or reward, an unknown finish reason):
    building `Sample` objects then names the response at fault.

    Raises:
        InvalidRecordError: a token id or logprob does not fit int32 / float32 (as `Sample` would).
    """
    token_parts = tuple(int32_array(t, "tokens") for t in tokens)
    logprob_parts = tuple(float32_array(lp, "logprobs") for lp in logprobs)
    codes = [FINISH_CODES.get(reason) for reason in finish_reasons]
    if None in codes:
        return None
    n = len(token_parts)
    scored = [None if r is None else float(r) for r in rewards]
    columns = SampleColumns(
        lengths=[len(t) for t in token_parts], rewards=[None if r is None or math.isnan(r) else r for r in scored],
        finish_codes=bytes(codes),  # type: ignore[arg-type]  # no None left: checked above
        has_logprobs=bytes(lp is not None for lp in logprob_parts), version_counts=[1] * n,
        versions=[int(v) for v in versions], has_loss_mask=bytes(n), span_counts=[0] * n, spans=(),
        text_lengths=[len(t) for t in texts], text="".join(texts), token_parts=token_parts,
        logprob_parts=tuple(lp for lp in logprob_parts if lp is not None), mask_parts=())
    try:
        return Samples.from_columns(columns)
    except InvalidRecordError:
        return None



def packed_samples(tokens: np.ndarray, lengths: Sequence[int], *, logprobs: np.ndarray | None,
                   loss_masks: np.ndarray | None, rewards: Sequence[float | None], finish_reasons: Sequence[str],
                   weight_versions: Sequence[Sequence[int]]) -> Samples:
    """The samples of `lengths` responses whose `tokens` are one 1-D array, back to back (and so their
    `logprobs` and `loss_masks`, given for every response or for none), without a `Sample` object per response
    and without splitting the arrays. The same samples, field for field and byte for byte once encoded, as
    `Sample` objects of those values (a NaN reward is None, as there).

    Raises:
        InvalidRecordError: a value does not fit its type (a token id beyond int32, a loss mask entry other
            than 0 or 1), or the group breaks an invariant (`check_columns`: the arrays' sizes and `lengths`,
            a non-finite logprob or reward, an unknown finish reason).
    """
    n = len(lengths)
    scored = [None if r is None else float(r) for r in rewards]
    versions = [tuple(int(v) for v in vs) for vs in weight_versions]
    token_array = int32_array(tokens, "tokens")
    logprob_array = float32_array(logprobs, "logprobs")
    mask_array = loss_mask_array(loss_masks)
    columns = SampleColumns(
        lengths=[int(length) for length in lengths],
        rewards=[None if r is None or math.isnan(r) else r for r in scored],
        finish_codes=bytes(finish_code(reason) for reason in finish_reasons),
        has_logprobs=bytes([logprob_array is not None] * n), version_counts=[len(vs) for vs in versions],
        versions=[v for vs in versions for v in vs], has_loss_mask=bytes([mask_array is not None] * n),
        span_counts=[0] * n, spans=(), text_lengths=[0] * n, text="", token_parts=(token_array,),
        logprob_parts=() if logprob_array is None else (logprob_array,),
        mask_parts=() if mask_array is None else (mask_array,))
    return Samples.from_columns(columns)
