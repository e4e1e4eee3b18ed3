"""A producer's share of the fleet's max_lag and its own outstanding groups (`rollstream.producers._share`).

Pinned here: the share is max_lag x the prompt partitions owned / all of them until a pushed position
came, then the mean of that and the consumption part (which starts from the partition part); shares of
producers that split the partitions and saw the same positions sum to at most max_lag; own outstanding
counts records not acknowledged yet and those at or beyond the committed offset of their partition (a late
or older commit never lowers it wrongly); a share below one group admits only while nothing is
outstanding; a fast producer's share grows, a slow one's shrinks, and the sum stays within max_lag.
"""

from __future__ import annotations

import random

import pytest
from rollstream.producers._share import FleetShare


def share(max_lag: int, owned: int, partitions: int) -> FleetShare:
    s = FleetShare(max_lag)
    s.set_partitions(partitions)
    s.set_owned(owned)
    return s


def test_the_share_follows_the_partitions_owned() -> None:
    assert FleetShare(64).share == 64  # partitions unknown: a producer alone
    assert share(64, 4, 128).share == 2.0 and share(64, 1, 128).share == 0.5
    assert sum(share(10, k, 7).share for k in (3, 2, 2)) == pytest.approx(10)
    s = share(64, 1, 128)
    s.set_owned(0)  # every partition revoked
    assert s.share == 0 and s.admits  # nothing outstanding: 0 <= 0


def test_own_outstanding_counts_pending_and_uncommitted_records() -> None:
    s = share(4, 1, 1)
    for _ in range(3):
        s.note_produced()
    assert s.outstanding == 3
    s.note_delivered(0, 10)
    s.note_delivered(1, 5)
    s.note_refused()  # on no partition: never in the lag
    assert s.outstanding == 2
    s.note_committed({0: 10, 1: 6}, pushed=False)  # offset 10 is the next to take: still outstanding
    assert s.outstanding == 1
    s.note_committed({0: 3}, pushed=False)  # behind what is known (another, older reading): ignored
    assert s.outstanding == 1
    s.note_committed({0: 11}, pushed=False)
    assert s.outstanding == 0
    s.note_produced()
    s.note_delivered(0, 9)  # committed already before its acknowledgement came
    assert s.outstanding == 0


def test_the_gate_test_is_own_at_most_share() -> None:
    s = share(3, 1, 2)  # share 1.5
    assert s.admits
    s.note_produced()
    assert s.admits  # 1 <= 1.5
    s.note_produced()
    assert not s.admits  # 2 > 1.5
    s.note_delivered(0, 0)
    s.note_delivered(0, 1)
    s.note_committed({0: 1}, pushed=False)
    assert s.admits and s.outstanding == 1


def test_a_share_below_one_group_admits_only_while_nothing_is_outstanding() -> None:
    s = share(64, 1, 128)  # 0.5
    assert s.admits
    s.note_produced()
    assert not s.admits
    s.note_delivered(3, 7)
    s.note_committed({3: 8}, pushed=True)
    assert s.admits  # every producer gets its turn each time the trainer commits what it published


def test_the_consumption_part_starts_with_the_first_pushed_position() -> None:
    s = share(64, 2, 4)
    s.note_committed({0: 0}, pushed=False)  # a read: no consumption part
    assert s.consumed is None and s.share == 32
    s.note_committed({0: 0}, pushed=True)
    assert s.consumed == 0.5 and s.share == 32  # starts from the partition part: (2/4 + 2/4) / 2 of 64
    for offset in range(8):
        s.note_produced()
        s.note_delivered(0, offset)
    s.note_committed({0: 8, 1: 24}, pushed=True)  # a quarter of what the trainer committed was this producer's
    assert s.consumed == pytest.approx(0.5 * 7 / 8 + 0.25 / 8) and s.share < 32


def _fleet_step(fleet: list[FleetShare], ends: dict[int, int], committed: dict[int, int], rng: random.Random,
                rates: list[float]) -> None:
    """Each producer publishes (at its rate, within its share) into random partitions; the trainer commits."""
    for producer, rate in zip(fleet, rates, strict=True):
        for _ in range(8):
            if rng.random() < rate and producer.admits:
                p = rng.randrange(4)
                producer.note_produced()
                producer.note_delivered(p, ends[p])
                ends[p] += 1
    # The bound: each admitted one more while at most its share (rounded down) was outstanding.
    assert sum(ends[p] - committed[p] for p in ends) <= sum(int(s.share) for s in fleet) + len(fleet)
    for p in committed:  # the trainer takes a prefix of each partition
        committed[p] = rng.randint(committed[p], ends[p])
    for producer in fleet:
        producer.note_committed(dict(committed), pushed=True)


def test_shares_sum_to_max_lag_and_follow_consumption() -> None:
    rng = random.Random(5)
    fleet = [share(40, k, 8) for k in (2, 2, 2, 2)]
    rates = [1.0, 1.0, 1.0, 0.05]  # the last producer is slow
    ends, committed = dict.fromkeys(range(4), 0), dict.fromkeys(range(4), 0)
    for _ in range(200):
        _fleet_step(fleet, ends, committed, rng, rates)
        assert sum(s.share for s in fleet) <= 40 + 1e-9
    assert sum(s.share for s in fleet) > 40 - 1  # what the slow one left unused went to the others
    slow, fast = fleet[-1].share, fleet[0].share
    assert slow < 40 / 4 < fast  # the fast ones took over what the slow one left unused
    # Every producer's outstanding is exactly its records beyond the committed offsets.
    assert sum(s.outstanding for s in fleet) == sum(ends[p] - committed[p] for p in ends)


def test_a_rebalance_moves_the_consumption_part_with_the_partitions() -> None:
    first, second = share(16, 4, 4), share(16, 0, 4)
    first.note_committed({0: 0}, pushed=True)  # the first position came while it owned every partition
    second.note_committed({0: 0}, pushed=True)
    assert (first.share, second.share) == (16, 0)
    first.set_owned(2)  # cooperative: revoked first ...
    second.set_owned(2)  # ... then assigned to the newcomer
    assert first.share == second.share == 8  # the sum stays max_lag, never 16 + 8
    first.set_owned(0)
    second.set_owned(4)
    assert (first.share, second.share) == (0, 16)


def test_in_a_stall_a_producer_admits_by_its_share_of_the_headroom() -> None:
    s = share(4, 1, 4)  # share 1
    assert s.admits_in_stall(0, 2)  # nothing produced since the reading: its turn
    assert not s.admits_in_stall(1, 2)  # 1 > 1/4 x (4 - 2)
    assert s.admits_in_stall(2, 0) is False and s.admits_in_stall(1, 0)  # 1 <= 1/4 x 4
    # Producers reading one after another in a stall (the lag only grows) add at most the headroom together.
    fleet, lag = [share(40, 1, 4) for _ in range(4)], 12
    for producer in fleet:
        added = 0
        while producer.admits_in_stall(added, lag):
            added += 1
        lag += added
    assert 12 < lag <= 40 + len(fleet)  # each admitted while at most its part of what was left
    assert FleetShare(0).admits_in_stall(0, 5) and not FleetShare(0).admits_in_stall(1, 0)
