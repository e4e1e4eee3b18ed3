"""`plain_samples`: a producer's plain responses (no loss mask, no version spans, no resume points, one
weight version each) as a group's `SampleColumns`, without a `Sample` object per response. The producer's
hot path (`rollstream.producers._groups`); every other group is built from `Sample` objects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from rollstream.schemas._errors import InvalidRecordError
from rollstream.schemas._packing import float32_array, int32_array
from rollstream.schemas._sample_checks import FINISH_CODES
from rollstream.schemas._samples import SampleColumns, Samples


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

