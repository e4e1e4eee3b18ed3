"""Batch.to_tensors and the slime sample conversion, checked value by value (no broker): loss masks and
per-token policy versions included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from rollstream.consumers import Batch, grpo_advantages
from rollstream.consumers.filters import staleness_of
from rollstream.consumers.slime import to_slime_group
from rollstream.schemas import RollstreamError, Sample, ScoredGroup, decode, encode

from tests.records import make_group, make_multi_turn_group


def batch_of(*groups: ScoredGroup) -> Batch:
    return Batch(step=3, groups=groups, positions=tuple((0, i) for i in range(len(groups))), ranges=(),
                 dispositions=(), offsets={0: len(groups)}, consumer_group="g", topic="t")


def test_tensors_are_padded_masked_and_aligned() -> None:
    a = make_group("a", rewards=(1.0, 0.0), prompt_len=3, response_len=2)   # responses of 2 and 3 tokens
    b = make_group("b", rewards=(0.5, 0.5, 2.0), prompt_len=1, response_len=1, logprobs=False)
    t = batch_of(a, b).to_tensors(pad_id=-1)
    assert t.input_ids.shape == (5, 6) and t.input_ids.dtype == torch.long
    assert t.input_ids[1].tolist() == [1, 2, 3, 110, 111, 112]
    assert t.input_ids[0].tolist() == [1, 2, 3, 100, 101, -1]
    assert t.input_ids[2].tolist() == [1, 100, -1, -1, -1, -1]
    assert t.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0]
    assert t.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0] and t.loss_mask[4].tolist() == [0, 1, 1, 1, 0, 0]
    assert t.rollout_logprobs[1].tolist() == [0, 0, 0, -0.5, -1.5, -2.5]
    assert t.rollout_logprobs[2].tolist() == [0.0] * 6  # no logprobs from the engine
    assert t.prompt_lengths.tolist() == [3, 3, 1, 1, 1] and t.response_lengths.tolist() == [2, 3, 1, 2, 3]
    assert t.group_index.tolist() == [0, 0, 1, 1, 1]
    assert t.rewards.tolist() == [1.0, 0.0, 0.5, 0.5, 2.0]


def test_grpo_advantages_are_normalised_per_group() -> None:
    t = batch_of(make_group("a", rewards=(1.0, 0.0)), make_group("b", rewards=(0.5, 0.5, 2.0))).to_tensors()
    std_a = math.sqrt(0.5)  # unbiased std of (1, 0)
    expected = [0.5 / (std_a + 1e-6), -0.5 / (std_a + 1e-6), *grpo_advantages([0.5, 0.5, 2.0])]
    assert t.advantages.tolist() == pytest.approx(expected, rel=1e-5)
    assert sum(t.advantages[2:].tolist()) == pytest.approx(0.0, abs=1e-5)
    assert grpo_advantages([3.0]) == [0.0]  # a single sample has no spread


def test_tensors_refuse_unscored_samples() -> None:
    with pytest.raises(RollstreamError, match="a#0 sample 1 has no reward"):
        batch_of(make_group("a", rewards=(1.0, None))).to_tensors()


def test_slime_samples_follow_slime_field_semantics(slime_path) -> None:
    from slime.utils.types import Sample as SlimeSample  # the stand-in of slime/utils/types.py (tests/standins)

    group = ScoredGroup(group_id="q#2", prompt_id="q", epoch=2, prompt_tokens=[7, 8], prompt="Q?", started_at_ms=0,
                        finished_at_ms=1, metadata={"label": "42"}, samples=[
                            Sample(tokens=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], text="abc", reward=1.0,
                                   finish_reason="stop", weight_versions=(4, 5)),
                            Sample(tokens=[9], text="z", reward=0.0, finish_reason="length")])
    first, second = to_slime_group(group, group_index=6, position=(2, 40))
    assert first.tokens == [7, 8, 1, 2, 3] and first.response_length == 3 and first.response == "abc"
    assert first.loss_mask == [1, 1, 1] and first.rollout_log_probs == pytest.approx([-0.1, -0.2, -0.3])
    assert first.reward == 1.0 and first.weight_versions == ["4", "5"] and first.label == "42"
    assert first.status is SlimeSample.Status.COMPLETED and second.status is SlimeSample.Status.TRUNCATED
    assert second.rollout_log_probs is None and second.loss_mask == [1] and second.tokens == [7, 8, 9]
    assert (first.group_index, first.index, second.index) == (6, 12, 13) and first.prompt == "Q?"
    assert first.metadata == {"group_id": "q#2", "prompt_id": "q", "epoch": 2, "partition": 2, "offset": 40,
                              "producer_id": ""}
    assert first.remove_sample is False
    failed = make_group("f", status="failed")
    assert {s.status for s in to_slime_group(failed, 0)} == {SlimeSample.Status.FAILED}


def test_tensors_match_a_row_by_row_reference_on_random_groups() -> None:
    rng = np.random.default_rng(7)
    groups = []
    for g in range(12):
        samples = []
        for _ in range(int(rng.integers(1, 5))):
            tokens = rng.integers(0, 1000, rng.integers(0, 9))
            logprobs = None if rng.random() < 0.3 else -rng.random(len(tokens), dtype=np.float32)
            samples.append(Sample(tokens=tokens, logprobs=logprobs, reward=float(rng.random())))
        groups.append(ScoredGroup(group_id=f"r{g}#0", prompt_id=f"r{g}", epoch=0,
                                  prompt_tokens=rng.integers(0, 1000, rng.integers(0, 6)), samples=samples,
                                  started_at_ms=0, finished_at_ms=1))
    t = batch_of(*groups).to_tensors(pad_id=-7)
    rows = [(g, s) for g in groups for s in g.samples]
    width = max(len(g.prompt_tokens) + len(s.tokens) for g, s in rows)
    assert t.input_ids.shape == (len(rows), width)
    for b, (g, s) in enumerate(rows):
        p, r = len(g.prompt_tokens), len(s.tokens)
        expected = [*g.prompt_tokens.tolist(), *s.tokens.tolist()] + [-7] * (width - p - r)
        assert t.input_ids[b].tolist() == expected
        assert t.attention_mask[b].tolist() == [1] * (p + r) + [0] * (width - p - r)
        assert t.loss_mask[b].tolist() == [0] * p + [1] * r + [0] * (width - p - r)
        lp = s.logprobs.tolist() if s.logprobs is not None else [0.0] * r
        assert t.rollout_logprobs[b].tolist() == pytest.approx([0.0] * p + lp + [0.0] * (width - p - r))


def test_the_slime_adapter_says_slime_is_missing() -> None:
    from rollstream.consumers.slime import sample_class

    with pytest.raises(RollstreamError, match="install slime"):
        sample_class()


@pytest.mark.parametrize("decoded", [False, True])
def test_tensors_train_only_policy_tokens_and_carry_their_versions(decoded: bool) -> None:
    multi = make_multi_turn_group()  # prompt 1 2 3; sample 0: 11 12 [13 14 tool] 15 by versions 3, 3, 4, 4, 4
    plain = make_group("p", rewards=(1.0, 0.0), prompt_len=1, response_len=1)  # no versions: unknown
    if decoded:
        multi, plain = decode(encode(multi), ScoredGroup), decode(encode(plain), ScoredGroup)
    t = batch_of(multi, plain).to_tensors(pad_id=-1)
    assert t.input_ids[0].tolist() == [1, 2, 3, 11, 12, 13, 14, 15]
    assert t.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]  # the tool tokens 13 14 are not trained
    assert t.loss_mask[1].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]  # no mask: the whole response
    assert t.loss_mask[3].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    assert t.token_versions.dtype == torch.long
    assert t.token_versions[0].tolist() == [-1, -1, -1, 3, 3, 4, 4, 4]  # where rollout_logprobs sit
    assert t.rollout_logprobs[0].tolist() == [0, 0, 0, -0.5, -0.25, 0, 0, -1.0]
    assert t.token_versions[1].tolist() == [-1, -1, -1, 4, 4, -1, -1, -1]
    assert t.token_versions[2:].eq(-1).all()  # samples without a version
    moved = batch_of(multi, plain).to_tensors(pad_id=-1, device="cpu")
    assert moved.token_versions.equal(t.token_versions) and moved.loss_mask.equal(t.loss_mask)
    assert staleness_of(multi, 6) == 3  # counted from the oldest version that generated a token


def test_slime_samples_carry_the_loss_mask_and_every_version(slime_path) -> None:
    first, second = to_slime_group(decode(encode(make_multi_turn_group()), ScoredGroup), group_index=1)
    assert first.loss_mask == [1, 1, 0, 0, 1] and len(first.loss_mask) == first.response_length
    assert first.weight_versions == ["3", "4"] and second.weight_versions == ["4"]  # distinct, oldest first
    assert first.rollout_log_probs == pytest.approx([-0.5, -0.25, 0.0, 0.0, -1.0])
    assert second.loss_mask == [1, 1] and first.tokens == [1, 2, 3, 11, 12, 13, 14, 15]
