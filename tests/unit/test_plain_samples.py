"""`rollstream.schemas.plain_samples`: a producer's plain responses as columns, without a `Sample` per response.

Pinned: the columns encode to exactly the bytes the `Sample` path encodes (so the wire cannot tell), read
back as the same samples; anything the per-sample checks must name (a NaN logprob, an infinite reward,
a logprob count that differs, an unknown finish reason) returns None so that path runs and names it;
a token id beyond int32 raises as `Sample` does.
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
    float32_array,
    int32_array,
    make_group_id,
    plain_samples,
)


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


@pytest.mark.parametrize("length", [7, 501, 5000])  # short parts are checked one by one, long ones joined
def test_a_non_finite_logprob_anywhere_takes_the_sample_path(length: int) -> None:
    logprobs = [np.zeros(length, np.float32), np.zeros(length, np.float32)]
    logprobs[1][length - 1] = np.inf
    tokens = [np.zeros(length, np.int32)] * 2
    assert plain_samples(tokens, logprobs, ["a", "b"], [None, None], ["stop", "stop"], [0, 0]) is None
    logprobs[1][length - 1] = 0.0
    assert plain_samples(tokens, logprobs, ["a", "b"], [None, None], ["stop", "stop"], [0, 0]) is not None


def test_a_token_beyond_int32_raises_as_sample_does() -> None:
    with pytest.raises(InvalidRecordError, match="tokens"):
        plain_samples([[2**31]], [None], ["x"], [None], ["stop"], [0])


def test_token_and_logprob_lists_convert_as_numpy_does_and_read_only() -> None:
    rng = np.random.default_rng(1)
    tokens, logprobs = rng.integers(0, 150_000, 700).tolist(), (-rng.random(700)).tolist()  # what JSON gives
    fast = plain_samples([tokens, tuple(tokens[:3])], [logprobs, None], ["a", "b"], [None, 1.0], ["stop", "length"],
                         [0, 0])
    assert fast is not None
    as_numpy = plain_samples([np.asarray(tokens, np.int32), np.asarray(tokens[:3], np.int32)],
                             [np.asarray(logprobs, np.float32), None], ["a", "b"], [None, 1.0],
                             ["stop", "length"], [0, 0])
    assert encode(_group(fast)) == encode(_group(as_numpy))
    converted = int32_array(tokens, "tokens"), float32_array(logprobs, "logprobs")
    assert [a.dtype for a in converted] == [np.int32, np.float32] and not any(a.flags.writeable for a in converted)


@pytest.mark.parametrize(("tokens", "words"), [
    ([1, 2.5], "expected integers"),
    ([True, False], "expected integers"),
    ([1, 2**31], "must fit int32"),
    ([-2**31 - 1], "must fit int32"),
    (["7"], "expected integers"),
    ([[1], [2]], "1-D"),
])
def test_lists_that_are_no_token_ids_are_refused_naming_the_field(tokens: list, words: str) -> None:
    with pytest.raises(InvalidRecordError, match=f"tokens.*{words}"):
        plain_samples([tokens], [None], ["x"], [None], ["stop"], [0])
