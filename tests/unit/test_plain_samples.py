"""`schemas.plain_samples`: a producer's plain responses as columns, without a `Sample` per response.

Pinned: the columns encode to exactly the bytes the `Sample` path encodes (so the wire cannot tell), read
back as the same samples; anything the per-sample checks must name (a NaN logprob, an infinite reward,
a logprob count that differs, an unknown finish reason) returns None so that path runs and names it;
a token id beyond int32 raises as `Sample` does.
"""

from __future__ import annotations

import numpy as np
import pytest

from schemas import InvalidRecordError, Sample, Samples, ScoredGroup, decode, encode, make_group_id, plain_samples


def _group(samples: Samples) -> ScoredGroup:
    return ScoredGroup(group_id=make_group_id("p", 0), prompt_id="p", epoch=0, prompt_tokens=[1, 2, 3],
                       samples=samples, started_at_ms=1, finished_at_ms=2, prompt="q", producer_id="t")


def _columns() -> dict[str, list]:
    rng = np.random.default_rng(0)
    tokens = [rng.integers(0, 150_000, n, dtype=np.int32) for n in (5, 0, 3)]
    return {"tokens": tokens, "logprobs": [-rng.random(len(t), dtype=np.float32) for t in tokens[:2]] + [None],
            "texts": ["a", "", "üñï 𝄞"], "rewards": [1.0, None, float("nan")],
            "finish_reasons": ["stop", "length", "abort"], "versions": [3, 3, 4]}


def test_plain_columns_encode_exactly_as_samples_do() -> None:
    c = _columns()
    fast = plain_samples(c["tokens"], c["logprobs"], c["texts"], c["rewards"], c["finish_reasons"], c["versions"])
    assert fast is not None and fast.columns is not None
    slow = Samples([Sample(tokens=t, logprobs=lp, text=x, reward=r, finish_reason=f, weight_versions=(v,))
                    for t, lp, x, r, f, v in zip(*c.values(), strict=True)])
    assert encode(_group(fast)) == encode(_group(slow))
    assert fast == slow and decode(encode(_group(fast)), ScoredGroup).samples == slow
    assert fast.rewards == [1.0, None, None]  # NaN: no score, as Sample reads it


@pytest.mark.parametrize("change", [
    {"logprobs": [np.array([np.nan, 0, 0, 0, 0], np.float32), None, None]},
    {"rewards": [float("inf"), None, None]},
    {"logprobs": [np.zeros(4, np.float32), None, None]},
    {"finish_reasons": ["eos", "stop", "stop"]},
])
def test_what_only_the_sample_checks_can_name_takes_that_path(change: dict[str, list]) -> None:
    c = {**_columns(), **change}
    assert plain_samples(c["tokens"], c["logprobs"], c["texts"], c["rewards"], c["finish_reasons"],
                         c["versions"]) is None
    with pytest.raises(InvalidRecordError):
        Samples([Sample(tokens=t, logprobs=lp, text=x, reward=r, finish_reason=f, weight_versions=(v,))
                 for t, lp, x, r, f, v in zip(*c.values(), strict=True)])


def test_a_token_beyond_int32_raises_as_sample_does() -> None:
    with pytest.raises(InvalidRecordError, match="tokens"):
        plain_samples([[2**31]], [None], ["x"], [None], ["stop"], [0])
