"""What the trainer adapters share (`rollstream.consumers._adapters`) and slime's settings. Pinned here:

1. The group-size filter names the trainer and its setting, and lets any size through when none is expected.
2. `StepMetrics.of` counts a batch's dispositions, its filter reasons by label and the staleness of its taken
   groups; slime's and TRL's metric dicts are both built from it (same counts under each trainer's names).
3. `SlimeSettings` refuses, by name, values no take could run with (validated however it is built).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rollstream.consumers import _trl_pipeline, slime
from rollstream.consumers._adapters import StepMetrics, group_size_filter
from rollstream.consumers._batch import Batch
from rollstream.consumers.filters import FilterContext
from rollstream.schemas import ConfigError, OffsetDisposition, PartitionRange

from tests.records import make_group


def _batch() -> Batch:
    groups = (make_group("a", versions=(3,)), make_group("b", versions=(5,)), make_group("c"))
    dispositions = (
        OffsetDisposition(0, 0, "taken", groups[0].group_id),
        OffsetDisposition(0, 1, "filtered", "g-x", reason="all_rewards_equal: 1.0"),
        OffsetDisposition(0, 2, "taken", groups[1].group_id),
        OffsetDisposition(0, 3, "requeued", "g-y", reason="stale: 4 versions behind", attempt=1),
        OffsetDisposition(0, 4, "filtered", "g-z", reason="all_rewards_equal: 0.0"),
        OffsetDisposition(0, 5, "duplicate", groups[0].group_id),
        OffsetDisposition(0, 6, "taken", groups[2].group_id),
    )
    return Batch(step=7, groups=groups, positions=((0, 0), (0, 2), (0, 6)), ranges=(PartitionRange(0, 0, 7),),
                 dispositions=dispositions, offsets={0: 7}, consumer_group="g", topic="t.rollouts")


def test_group_size_filter_names_the_trainer_and_its_setting():
    context = FilterContext(policy_version=None, max_staleness=None, partition=0, offset=0, consumer_group="g")
    check = group_size_filter(3, trainer="slime", setting="n_samples_per_prompt")
    assert check(make_group("p", rewards=(0.0, 1.0)), context) == \
        "group_size: 2 samples, slime expects n_samples_per_prompt=3"
    assert check(make_group("p", rewards=(0.0, 1.0, 0.5)), context) is None
    assert group_size_filter(None, trainer="TRL", setting="num_generations")(make_group("p"), context) is None


def test_step_metrics_count_a_batch():
    m = StepMetrics.of(_batch(), weight_version=6, lag=11)
    assert (m.step, m.weight_version, m.lag) == (7, 6, 11)
    assert {k: m.counts[k] for k in ("taken", "filtered", "requeued", "duplicate", "undecodable")} == \
        {"taken": 3, "filtered": 2, "requeued": 1, "duplicate": 1, "undecodable": 0}
    assert m.filtered_by_reason == {"all_rewards_equal": 2}
    assert m.staleness == (3, 1) and m.staleness_mean == 2.0 and m.staleness_max == 3  # "c" has no version


def test_slime_and_trl_report_the_same_counts():
    batch = _batch()
    consumer = SimpleNamespace(estimated_lag=lambda: 11)
    from_slime = slime._metrics(batch, 6, consumer)  # type: ignore[arg-type]
    from_trl = _trl_pipeline.take_metrics(batch, 6, 11, 0.25)
    assert from_slime["rollstream/filtered"] == from_trl["rollstream/filtered_total"] == 2
    assert from_slime["rollstream/requeued"] == from_trl["rollstream/requeued_total"] == 1
    assert from_slime["rollstream/staleness_max"] == from_trl["rollstream/staleness_max"] == 3
    assert from_trl["rollstream/filtered_all_rewards_equal_total"] == 2 and from_trl["rollstream/take_s"] == 0.25


@pytest.mark.parametrize(("attr", "value", "named"), [
    ("rollstream_take_timeout", "0", "rollstream_take_timeout=0.0"),
    ("rollstream_take_timeout", "soon", "rollstream_take_timeout='soon'"),
    ("rollstream_max_staleness", "-1", "rollstream_max_staleness=-1"),
    ("rollstream_max_staleness", "1.5", "rollstream_max_staleness='1.5'"),
    ("rollstream_slime_loop", "fast", "rollstream_slime_loop='fast'"),
    ("rollstream_eval_function_path", "evaluate", "rollstream_eval_function_path='evaluate'"),
])
def test_slime_settings_refuse_bad_values_by_name(monkeypatch, attr, value, named):
    for env in ("ROLLSTREAM_TAKE_TIMEOUT", "ROLLSTREAM_MAX_STALENESS", "ROLLSTREAM_SLIME_LOOP",
                "ROLLSTREAM_EVAL_FUNCTION_PATH"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(ConfigError) as err:
        slime.SlimeSettings.from_args(SimpleNamespace(**{attr: value}))
    assert named in str(err.value)


def test_slime_settings_defaults_are_valid():
    settings = slime.SlimeSettings.from_args(SimpleNamespace(rollstream_take_timeout="30",
                                                             rollstream_max_staleness="2"))
    assert (settings.take_timeout, settings.max_staleness, settings.loop) == (30.0, 2, None)


def test_slime_rollout_top_p_refused_at_the_first_call_with_the_fix_named():
    args = SimpleNamespace(rollout_top_p=0.9, rollout_batch_size=1)
    with pytest.raises(ConfigError, match=r"--rollout-top-p 0.9 .*rollout_top_p_token_ids.*--top-p"):
        slime.generate_rollout(args, 0)  # before any consumer or broker is made
    slime.check_top_p(SimpleNamespace(rollout_top_p=1.0))
    slime.check_top_p(SimpleNamespace())


def _samples(*logprobs):
    return [[SimpleNamespace(rollout_log_probs=lp) for lp in logprobs]]


def test_slime_batches_with_mixed_logprobs_go_without_them_or_fail_when_slime_needs_them(caplog):
    uniform = _samples([0.1], [0.2])
    slime.uniform_logprobs(uniform, SimpleNamespace())
    assert [s.rollout_log_probs for s in uniform[0]] == [[0.1], [0.2]]  # all present: kept
    mixed = _samples(None, [0.2], [0.3])  # slime would read "no logprobs" from the first and drop the rest
    slime.uniform_logprobs(mixed, SimpleNamespace())
    assert [s.rollout_log_probs for s in mixed[0]] == [None, None, None]
    assert "1 of 3 samples carry no logprobs" in caplog.text
    with pytest.raises(slime.RollstreamError, match="use_tis needs them"):
        slime.uniform_logprobs(_samples([0.1], None), SimpleNamespace(use_tis=True))
