"""Which step manifests count (shared by the consumer and the audit), and the audit's checks, without a broker.

Pinned here: a re-taken step supersedes its uncommitted manifest; a seek back supersedes what it
rewinds over; manifests past the committed offsets are pending; dedupe ids follow the effective steps.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from rollstream.consumers._ledger import StepLedger, epoch_of
from rollstream.consumers.forensics._audit import _check_manifest, _check_tiling, _check_unique_groups
from rollstream.consumers.forensics._replay import parse_time
from rollstream.schemas import OffsetDisposition, PartitionRange, RollstreamError, StepManifest


def manifest(step: int, ranges: dict[int, tuple[int, int]], ids: dict[tuple[int, int], str] | None = None,
             skip: set[tuple[int, int]] = frozenset()) -> StepManifest:
    """A manifest taking every offset of `ranges` (ids default to "g{p}-{o}#0"), minus `skip`."""
    ids = ids or {}
    disps = [OffsetDisposition(p, o, "taken", group_id=ids.get((p, o), f"g{p}-{o}#0"))
             for p, (s, e) in ranges.items() for o in range(s, e) if (p, o) not in skip]
    return StepManifest(step=step, consumer_group="g", topic="t", ranges=[PartitionRange(p, s, e) for p, (s, e)
                                                                          in ranges.items()], dispositions=disps)


def test_steps_accumulate_and_next_step_continues() -> None:
    ledger = StepLedger()
    assert ledger.next_step == 0
    ledger.add(manifest(0, {0: (0, 2)}))
    ledger.add(manifest(1, {0: (2, 4), 1: (0, 1)}))
    assert ledger.next_step == 2 and ledger.is_taken("g0-3#0") and ledger.is_taken("g1-0#0")
    assert ledger.drop_uncommitted({0: 4, 1: 1}) == []


def test_an_uncommitted_manifest_is_pending_and_its_ids_are_not_taken() -> None:
    ledger = StepLedger()
    ledger.add(manifest(0, {0: (0, 2)}))
    ledger.add(manifest(1, {0: (2, 4)}))  # written, then the trainer died before committing
    assert [d.step for d in ledger.drop_uncommitted({0: 2})] == [1]
    assert ledger.next_step == 1 and not ledger.is_taken("g0-2#0") and ledger.is_taken("g0-1#0")


def test_the_same_step_taken_again_supersedes_the_first_manifest() -> None:
    ledger = StepLedger(keep_manifests=True)
    ledger.add(manifest(0, {0: (0, 2)}))
    first = manifest(1, {0: (2, 4)})
    ledger.add(first)
    superseded = ledger.add(manifest(1, {0: (2, 5)}, ids={(0, 4): "late#0"}))  # re-taken after the crash
    assert [d.manifest for d in superseded] == [first]
    assert [m.step for m in ledger.effective()] == [0, 1] and ledger.is_taken("late#0")


def test_a_seek_back_supersedes_what_it_rewinds_over() -> None:
    ledger = StepLedger(keep_manifests=True)
    for step, r in enumerate([(0, 2), (2, 4), (4, 6)]):
        ledger.add(manifest(step, {0: r}))
    assert ledger.rewind({0: 2}) == [1, 2]
    assert not ledger.is_taken("g0-2#0") and ledger.is_taken("g0-0#0")
    ledger2 = StepLedger(keep_manifests=True)  # the audit sees the same thing from the log alone
    for step, r in enumerate([(0, 2), (2, 4), (4, 6)]):
        ledger2.add(manifest(step, {0: r}))
    ledger2.add(manifest(7, {0: (2, 3)}))  # no next_step given: numbering continued, offsets went back
    assert [m.step for m in ledger2.effective()] == [0, 7]


def test_dedupe_epochs_bound_the_remembered_ids() -> None:
    ledger = StepLedger(dedupe_epochs=1)
    for epoch in range(4):
        ledger.add(manifest(epoch, {0: (epoch, epoch + 1)}, ids={(0, epoch): f"p#{epoch}"}))
    assert [ledger.is_taken(f"p#{e}") for e in range(4)] == [False, False, True, True]
    assert epoch_of("a#b#12") == 12 and epoch_of("plain") is None


def test_audit_checks_dispositions_inside_a_manifest() -> None:
    counts: dict[str, int] = defaultdict(int)
    assert _check_manifest(manifest(0, {0: (0, 3)}), counts) == [] and counts["taken"] == 3
    [gap] = _check_manifest(manifest(4, {0: (0, 3)}, skip={(0, 1)}), counts)
    assert (gap.kind, gap.partition, gap.start, gap.steps) == ("gap", 0, 1, (4,))
    doubled = manifest(5, {0: (0, 1)})
    doubled = StepManifest(5, "g", "t", doubled.ranges, doubled.dispositions * 2)
    assert [p.kind for p in _check_manifest(doubled, counts)] == ["overlap"]


def test_audit_checks_ranges_tile_up_to_the_committed_offset() -> None:
    ms = [manifest(0, {0: (0, 2)}), manifest(1, {0: (2, 5)})]
    assert _check_tiling(0, ms, 0, 5) == []
    [gap] = _check_tiling(0, [ms[0], manifest(1, {0: (3, 5)})], 0, 5)
    assert gap.message == "partition 0 offsets [2, 3): in no step (after step 0, before step 1)"
    [overlap] = _check_tiling(0, [ms[0], manifest(1, {0: (1, 5)})], 0, 5)
    assert (overlap.kind, overlap.start, overlap.end, overlap.steps) == ("overlap", 1, 2, (0, 1))
    [tail] = _check_tiling(0, ms, 0, 7)
    assert tail.message == "partition 0 offsets [5, 7): committed but in no step (after step 1)"
    [head] = _check_tiling(0, ms[1:], 0, 5)
    assert "offsets [0, 2): in no step (from the start of the topic" in head.message
    assert _check_tiling(0, ms[1:], None, 5) == []  # from the first manifest


def test_audit_flags_a_group_taken_twice() -> None:
    ms = [manifest(0, {0: (0, 1)}, ids={(0, 0): "x#0"}), manifest(1, {0: (1, 2)}, ids={(0, 1): "x#0"})]
    [dup] = _check_unique_groups(ms)
    assert dup.kind == "duplicate_group" and dup.steps == (0, 1)


def test_parse_time_accepts_iso_and_relative() -> None:
    assert parse_time("10m", now=1000.0) == 400_000
    assert parse_time("1.5h", now=10_000.0) == 4_600_000
    assert parse_time("2025-01-31T12:00:00+00:00") == 1_738_324_800_000
    with pytest.raises(RollstreamError, match="ISO 8601"):
        parse_time("yesterday")


def test_a_rewrite_of_a_step_supersedes_only_its_twin() -> None:
    """A recorded step taken again as it was (after seek_to_step) keeps the recorded steps after it."""
    ledger = StepLedger(keep_manifests=True)
    for m in (manifest(0, {0: (0, 2)}), manifest(1, {0: (2, 4)}), manifest(2, {0: (4, 6)})):
        ledger.add(m)
    assert [s.step for s in ledger.add(manifest(1, {0: (2, 4)}))] == [1]  # the same step again: only its twin
    assert sorted(m.step for m in ledger.effective()) == [0, 1, 2]
    assert sorted(s.step for s in ledger.add(manifest(1, {0: (2, 5)}))) == [1, 2]  # a different step 1: both go
    assert sorted(m.step for m in ledger.effective()) == [0, 1]


def test_recorded_steps_chain_from_a_position_and_stop_at_the_first_that_does_not() -> None:
    from rollstream.consumers._resume import chained, latest_by_step, position_after

    steps = [manifest(3, {0: (5, 7), 1: (2, 3)}), manifest(4, {1: (3, 6)}), manifest(5, {0: (6, 9)})]
    assert [m.step for m in chained(steps, {0: 5, 1: 2})] == [3, 4]  # step 5 starts before step 3's end on 0
    assert [m.step for m in chained(list(reversed(steps[:2])), {0: 5, 1: 2})] == [3, 4]  # by step number
    assert chained(steps, {0: 6, 1: 2}) == []  # the first is behind the position already
    first, again = manifest(1, {0: (0, 2)}), manifest(1, {0: (0, 3)})
    assert latest_by_step([first, again, manifest(2, {0: (3, 4)})], [1]) == [again]
    assert position_after([manifest(0, {0: (0, 4)})], [manifest(1, {1: (7, 9)})], {0: 9, 1: 9, 2: 3}) == {
        0: 4, 1: 7, 2: 3}
