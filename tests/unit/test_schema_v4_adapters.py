"""The TRL adapter carries schema v4's loss mask: a multi-turn sample becomes the row TRL's own worker
builds of the same conversation (TRL 1.16, trl/experimental/async_grpo/async_rollout_worker.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("trl.experimental.async_grpo")
from rollstream.consumers._trl_samples import trainable  # noqa: E402
from rollstream.consumers.filters import FilterContext  # noqa: E402
from rollstream.consumers.trl import to_rollout_samples  # noqa: E402
from rollstream.schemas import Sample, ScoredGroup, decode, encode  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences  # noqa: E402

from tests.records import make_multi_turn_group  # noqa: E402


def test_trl_rows_mask_tool_tokens_as_trls_worker_chains_the_turns() -> None:
    group = decode(encode(make_multi_turn_group()), ScoredGroup)
    first, second = to_rollout_samples(group, model_version=group.oldest_weight_version)
    # The same conversation as TRL's worker records it (:127-138, :167-194): the policy writes 11 12, the tool's
    # 13 14 come back in the next turn's prompt (context: mask 0, logprob 0.0), then the policy writes 15.
    (expected,), _ = _chain_to_sequences([TurnRecord([1, 2, 3], [11, 12], [-0.5, -0.25]),
                                          TurnRecord([1, 2, 3, 11, 12, 13, 14], [15], [-1.0])], "r", 10)
    assert first.input_ids.tolist() == expected.input_ids
    assert first.completion_mask.tolist() == expected.completion_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert first.old_log_probs.tolist() == pytest.approx(expected.old_log_probs)
    assert second.completion_mask.tolist() == [0, 0, 0, 1, 1]  # no mask: the whole response
    assert first.model_version == second.model_version == 3  # one int in TRL: the oldest version


def test_trl_skips_a_group_with_a_sample_whose_every_token_is_masked() -> None:
    masked = Sample(tokens=[5, 6], logprobs=[0.0, 0.0], reward=1.0, loss_mask=np.zeros(2))
    group = make_multi_turn_group()
    keep = trainable
    context = FilterContext(policy_version=None, max_staleness=None, partition=0, offset=0, consumer_group="g")
    assert keep(group, context) is None
    skipped = ScoredGroup(group_id="z#0", prompt_id="z", epoch=0, prompt_tokens=[1], started_at_ms=0, finished_at_ms=1,
                          samples=[group.samples[0], masked])
    assert (keep(skipped, context) or "").startswith("empty_response")
