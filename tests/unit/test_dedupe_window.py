"""The dedupe window of the trainer's ledger (`rollstream.consumers._ledger`), without a broker.

Pinned here: an id taken at offset o of partition p is remembered while the window's position on p is less than
``offsets`` past its step's end *or* its step is less than ``seconds`` older than the newest (so a duplicate at
d - o <= offsets is always skipped); partitions are counted apart; the ledger stays bounded over a long run; a
rebuild with pending manifests remembers at least what the live ledger did; requeue attempts follow the same
rule; a rewind behind what was forgotten says so.
"""

from __future__ import annotations

import pytest
from rollstream.consumers import DedupeWindow
from rollstream.consumers._ledger import StepLedger
from rollstream.schemas import ConfigError, OffsetDisposition, PartitionRange, StepManifest


def manifest(step: int, ranges: dict[int, tuple[int, int]], *, ms: int = 0,
             requeued: dict[tuple[int, int], int] | None = None) -> StepManifest:
    """Every offset of `ranges` taken as "g{p}-{o}#0", except `requeued` ones (offset -> the group's attempt)."""
    requeued = requeued or {}
    disps = [OffsetDisposition(p, o, "requeued", group_id=f"g{p}-{o}#0", attempt=requeued[(p, o)], reason="stale")
             if (p, o) in requeued else OffsetDisposition(p, o, "taken", group_id=f"g{p}-{o}#0")
             for p, (s, e) in ranges.items() for o in range(s, e)]
    return StepManifest(step=step, consumer_group="g", topic="t", created_at_ms=ms,
                        ranges=[PartitionRange(p, s, e) for p, (s, e) in ranges.items()], dispositions=disps)


def run(ledger: StepLedger, steps: int, *, per_step: int = 4, ms_per_step: int = 0, partitions: int = 1,
        first: int = 0) -> None:
    """`steps` committed steps of `per_step` offsets on each partition, one after the other."""
    for k in range(first, first + steps):
        ledger.add(manifest(k, {p: (k * per_step, (k + 1) * per_step) for p in range(partitions)},
                            ms=k * ms_per_step))


def test_an_id_is_remembered_while_a_duplicate_within_the_offsets_can_come() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=10, seconds=0))
    run(ledger, 1)  # g0-0..g0-3 taken, the step ends at 4
    ledger.add(manifest(1, {0: (4, 13)}))
    assert ledger.is_taken("g0-3#0")  # position 13: a duplicate at 13 is 10 past offset 3
    ledger.add(manifest(2, {0: (13, 14)}))
    assert not ledger.is_taken("g0-3#0") and not ledger.is_taken("g0-0#0")  # every offset left is >= 14 > 3 + 10
    assert ledger.is_taken("g0-4#0") and ledger.next_step == 3


def test_both_bounds_must_pass_before_an_id_is_forgotten() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=10, seconds=60))
    run(ledger, 10, ms_per_step=1000)  # 40 offsets in 9 s: far past in offsets, not in time
    assert ledger.is_taken("g0-0#0")
    ledger.add(manifest(10, {0: (40, 41)}, ms=60_000))  # 60 s after step 0 was written
    assert not ledger.is_taken("g0-0#0") and ledger.is_taken("g0-4#0")  # step 1 is 59 s old
    slow = StepLedger(window=DedupeWindow(offsets=100, seconds=1))
    run(slow, 10, ms_per_step=60_000)  # old in time, but within 100 offsets
    assert slow.is_taken("g0-0#0")


def test_partitions_are_counted_apart() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=4, seconds=0))
    ledger.add(manifest(0, {0: (0, 2), 1: (0, 2)}))
    ledger.add(manifest(1, {0: (2, 10)}))  # only partition 0 moves on
    assert not ledger.is_taken("g0-1#0") and ledger.is_taken("g1-1#0")
    assert len(ledger) == 2  # step 0 still holds partition 1
    ledger.add(manifest(2, {1: (2, 6)}))
    assert not ledger.is_taken("g1-1#0") and len(ledger) == 2  # step 0 dropped whole; steps 1 and 2 remain
    assert ledger.next_step == 3


def test_a_long_run_stays_bounded_and_numbers_steps_on() -> None:
    window = DedupeWindow(offsets=64, seconds=5)
    ledger = StepLedger(window=window)
    run(ledger, 5000, per_step=8, ms_per_step=100, partitions=3)  # 120,000 groups, 500 s
    # Kept: the ids within 64 offsets (plus the step that crosses it) or within 5 s (50 steps x 8) per partition.
    assert ledger.remembered <= 3 * (50 + 1) * 8 and len(ledger) <= 52
    assert ledger.next_step == 5000
    assert ledger.is_taken("g2-39999#0") and not ledger.is_taken("g2-0#0")
    unbounded = StepLedger()
    run(unbounded, 500, per_step=8, partitions=3)
    assert unbounded.remembered == 12_000  # without a window, every id of the run


def test_a_rebuild_remembers_at_least_what_the_live_ledger_did() -> None:
    window = DedupeWindow(offsets=8, seconds=0)
    live = StepLedger(window=window)
    run(live, 6)  # committed up to 24
    # The trainer then wrote steps 6 and 7 (to 40) and died before committing them.
    rebuilt = StepLedger(window=window, committed={0: 24})
    run(rebuilt, 8)
    assert [d.step for d in rebuilt.drop_uncommitted({0: 24})] == [6, 7]
    remembered = {f"g0-{o}#0" for o in range(40) if live.is_taken(f"g0-{o}#0")}
    assert remembered and all(rebuilt.is_taken(g) for g in remembered)
    assert rebuilt.next_step == live.next_step == 6
    careless = StepLedger(window=window)  # had the pending steps moved the window, 16..23 would be forgotten
    run(careless, 8)
    careless.drop_uncommitted({0: 24})
    assert not careless.is_taken("g0-16#0") and rebuilt.is_taken("g0-16#0")


def test_requeue_attempts_follow_the_window() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=10, seconds=0))
    ledger.add(manifest(0, {0: (0, 4)}, requeued={(0, 1): 0}))
    ledger.note_requeued("late#0", 1, 0, 3, early=True)  # a timed-out take published it
    assert ledger.requeued_as("g0-1#0") == 1 and ledger.requeued_from(0, 3)
    ledger.add(manifest(1, {0: (4, 11)}))
    assert ledger.requeued_as("g0-1#0") == 1  # a duplicate of the stale group at 11 is still "already requeued"
    ledger.add(manifest(2, {0: (11, 14)}))
    assert ledger.requeued_as("g0-1#0") == 0 and not ledger.requeued_from(0, 3)
    assert ledger.requeued_as("late#0") == 0


def test_a_higher_attempt_outlives_the_older_note() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=10, seconds=0))
    ledger.add(manifest(0, {0: (0, 2)}, requeued={(0, 1): 0}))
    ledger.add(manifest(1, {0: (2, 9)}, requeued={(0, 8): 1}))  # its regeneration went stale too, at offset 8
    ledger.add(manifest(2, {0: (9, 12)}))
    assert ledger.requeued_as("g0-1#0") == 0 and ledger.requeued_as("g0-8#0") == 2


def test_a_rewind_behind_what_was_forgotten_says_so() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=8, seconds=0))
    run(ledger, 10)  # 40 offsets; forgotten up to the step ending at 32 - 8 = 24... ends <= 32
    assert not ledger.forgot_within({0: 40}) and ledger.forgot_within({0: 30})
    assert ledger.rewind({0: 36}) == [9]
    assert not ledger.is_taken("g0-36#0") and ledger.is_taken("g0-35#0") and ledger.next_step == 9
    never = StepLedger()
    run(never, 10)
    assert not never.forgot_within({0: 0})
    fresh = StepLedger(window=DedupeWindow(offsets=8, seconds=0))
    run(fresh, 2)  # nothing forgotten yet: a seek anywhere needs no rebuild
    assert not fresh.forgot_within({0: 0})


def test_a_seek_to_an_earlier_step_number_lowers_the_next_step() -> None:
    ledger = StepLedger(window=DedupeWindow(offsets=4, seconds=0))
    run(ledger, 10)  # steps 0..7 dropped whole
    assert len(ledger) < 10 and ledger.next_step == 10
    ledger.add(manifest(3, {0: (40, 44)}))  # seek_to(..., next_step=3): rule 1 supersedes steps >= 3
    assert ledger.next_step == 4


def test_the_window_is_validated() -> None:
    with pytest.raises(ConfigError, match="offsets=-1"):
        DedupeWindow(offsets=-1)
    with pytest.raises(ConfigError, match="dedupe_window=None"):
        DedupeWindow(seconds=-1.0)
    assert StepLedger(keep_manifests=True, window=DedupeWindow(0, 0)).remembered == 0
