"""The slime adapter against a real broker: slime's rollout-function contract and commit timing.

Pinned here: each call returns exactly rollout_batch_size groups of slime-style samples; a group of
the wrong size for slime is skipped with a recorded reason; a rollout's batch is committed when slime
asks for the next one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from consumers import audit
from consumers.slime import SlimeSample, close, generate_rollout
from infra import LagReader
from schemas import RollstreamError
from tests.records import make_group, publish


def test_generate_rollout_feeds_slime(bootstrap_servers, kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = [make_group(f"s{i}", versions=(3,)) for i in range(3)]
    groups.insert(1, make_group("three", rewards=(0.0, 1.0, 0.5)))  # slime expects 2 samples per prompt
    groups += [make_group(f"t{i}") for i in range(3)]
    publish(kafka_config, names, groups)
    args = SimpleNamespace(rollout_batch_size=3, n_samples_per_prompt=2, rollstream_bootstrap_servers=bootstrap_servers,
                           rollstream_namespace=names.namespace, rollstream_group=group_id, rollstream_take_timeout=30)
    try:
        rollout = generate_rollout(args, 0, data_buffer=None)
        assert [[s.metadata["group_id"] for s in g] for g in rollout] == [["s0#0"] * 2, ["s1#0"] * 2, ["s2#0"] * 2]
        sample = rollout[0][1]
        assert isinstance(sample, SlimeSample) and sample.status is SlimeSample.Status.COMPLETED
        assert sample.tokens == [1, 2, 3, *groups[0].samples[1].tokens.tolist()]
        assert sample.response_length == len(sample.loss_mask) == len(sample.rollout_log_probs) == 5
        assert sample.reward == 1.0 and sample.weight_versions == ["3"] and sample.group_index == 0
        with LagReader(kafka_config) as lag:
            assert lag.group_lag(group_id, names.rollouts).partitions[0].committed is None  # not yet handed on
            generate_rollout(args, 1, data_buffer=None)  # slime asks for the next: the first is committed
            assert lag.group_lag(group_id, names.rollouts).partitions[0].committed == 4
        with pytest.raises(RollstreamError, match="eval-function-path"):
            generate_rollout(args, 2, data_buffer=None, evaluation=True)
    finally:
        close(args)
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.counts["filtered"] == 1 and report.steps == (0,)
