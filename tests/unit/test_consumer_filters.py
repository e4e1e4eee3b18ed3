"""Built-in group filters, record-by-record decisions of one take, and their metrics (no broker)."""

from __future__ import annotations

import pytest
from rollstream.consumers import ConsumerMetrics, FilterContext, FilterError, default_filters
from rollstream.consumers._gather import Entry, Gathering
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers.filters import (
    all_rewards_equal,
    failed_group,
    reason_label,
    reward_missing,
    stale,
    staleness_of,
)
from rollstream.schemas import encode

from tests.records import make_group


def ctx(policy_version: int | None = None, max_staleness: int | None = None) -> FilterContext:
    return FilterContext(policy_version, max_staleness, partition=0, offset=0, consumer_group="g")


def test_failed_group_reason_carries_the_error() -> None:
    assert failed_group(make_group("a", status="failed"), ctx()) == "failed: engine exploded"
    assert failed_group(make_group("a"), ctx()) is None


def test_reward_missing_and_empty_groups() -> None:
    assert reward_missing(make_group("a", rewards=(1.0, None)), ctx()) == "reward_missing"
    assert reward_missing(make_group("a", rewards=()), ctx()) == "no_samples"
    assert reward_missing(make_group("a", rewards=(1.0, 0.0)), ctx()) is None


def test_all_rewards_equal_only_for_two_or_more_samples() -> None:
    assert all_rewards_equal(make_group("a", rewards=(1.0, 1.0, 1.0)), ctx()) == "all_rewards_equal"
    assert all_rewards_equal(make_group("a", rewards=(1.0,)), ctx()) is None
    assert all_rewards_equal(make_group("a", rewards=(1.0, 0.5)), ctx()) is None
    assert all_rewards_equal in default_filters() and all_rewards_equal not in default_filters(dynamic_sampling=False)


def test_staleness_uses_the_oldest_weight_version() -> None:
    group = make_group("a", versions=(3, 5))  # every sample carries versions 3 and 5: oldest is 3
    assert staleness_of(group, 7) == 4
    assert stale(group, ctx(policy_version=7, max_staleness=4)) is None
    assert stale(group, ctx(policy_version=8, max_staleness=4)) == "stale: 5 versions behind (max 4)"
    assert stale(group, ctx(policy_version=None, max_staleness=0)) is None  # unknown version: inactive
    assert stale(make_group("a"), ctx(policy_version=9, max_staleness=0)) is None  # unversioned samples


def test_reason_labels_are_the_prefix() -> None:
    assert reason_label("failed: engine exploded") == "failed"
    assert reason_label("stale: 5 versions behind") == "stale"
    assert reason_label("reward_missing") == "reward_missing"


def entry(group_or_bytes, partition: int = 0, offset: int = 0) -> Entry:
    value = group_or_bytes if isinstance(group_or_bytes, bytes) else encode(group_or_bytes)
    return Entry(partition, offset, b"key", value)


def gathering(filters=None, taken=frozenset(), **kw) -> Gathering:
    ledger = StepLedger()
    ledger.hold(taken)
    return Gathering("ns.rollouts", "g", default_filters() if filters is None else filters,
                     ledger, kw.pop("dedupe", True), kw.pop("policy_version", None),
                     kw.pop("max_staleness", None))


def test_each_record_gets_exactly_one_disposition_in_check_order() -> None:
    g = gathering(taken={"old#0"}, policy_version=10, max_staleness=2)
    records = [
        (b"\x00garbage", "undecodable"),
        (make_group("old"), "duplicate"),            # taken in an earlier step
        (make_group("a"), "taken"),
        (make_group("a"), "duplicate"),              # same id twice in one step
        (make_group("f", status="failed"), "filtered"),
        (make_group("m", rewards=(1.0, None)), "filtered"),
        (make_group("e", rewards=(1.0, 1.0)), "filtered"),
        (make_group("s", versions=(7,)), "filtered"),
        (make_group("ok", versions=(8,)), "taken"),
    ]
    kinds = [g.evaluate(entry(r, offset=i)).kind for i, (r, _) in enumerate(records)]
    assert kinds == [k for _, k in records]
    assert [d.offset for d in g.dispositions] == list(range(len(records)))
    assert g.dispositions[0].group_id == "key" and "c301" in (g.dispositions[0].reason or "")
    assert [d.reason for d in g.dispositions if d.kind == "filtered"] == [
        "failed: engine exploded", "reward_missing", "all_rewards_equal", "stale: 3 versions behind (max 2)"]
    assert [x.group_id for x in g.groups] == ["a#0", "ok#0"] and g.positions == [(0, 2), (0, 8)]
    assert [(r.partition, r.start, r.end) for r in g.ranges()] == [(0, 0, 9)]


def test_dedupe_off_takes_repeats_and_custom_filters_compose() -> None:
    def no_b(group, context):
        return "custom: no b" if group.prompt_id.startswith("b") else None

    g = gathering(filters=(no_b,), dedupe=False)
    kinds = [g.evaluate(entry(make_group(p), offset=i)).kind for i, p in enumerate(["a", "a", "b1"])]
    assert kinds == ["taken", "taken", "filtered"]


def test_a_raising_filter_is_a_clear_error() -> None:
    def broken(group, context):
        raise KeyError("label")

    with pytest.raises(FilterError, match="broken raised KeyError.*partition 0 offset 5"):
        gathering(filters=(broken,)).evaluate(entry(make_group("a"), offset=5))


def test_metrics_live_in_their_own_registry() -> None:
    a, b = ConsumerMetrics(), ConsumerMetrics()
    a.groups_taken.inc(3)
    assert a.registry.get_sample_value("rollstream_consumer_groups_taken_total") == 3
    assert b.registry.get_sample_value("rollstream_consumer_groups_taken_total") == 0
