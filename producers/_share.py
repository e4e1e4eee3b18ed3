"""A producer's share of the fleet's one `max_lag`, and the groups it has outstanding against it.

`max_lag` bounds the trainer group's lag for the whole fleet, and every producer starts a prompt only
while its *own* outstanding groups are at most its *share*, so whatever the number of producers the lag
stays within max_lag + in flight, with no coordinator:

- **Own outstanding**: the records this producer produced that the trainer group has not committed yet:
  those the broker has not acknowledged (`note_produced` .. `note_delivered` / `note_refused`), and those
  it acknowledged (partition, offset) at or beyond the group's committed offset there, as the latest
  committed offsets said (`note_committed`: the trainer's pushed position, or the gate's own lag read;
  committed offsets only move forward, so a late one counts too many, never too few).
- **Share** = max_lag x (partition part + consumption part) / 2, two fractions that each sum to at most
  one over the fleet:
  - partition part: the share of NS.prompts partitions this producer owns in the producers' consumer
    group (`set_owned`, from its rebalance callbacks; both group protocols, cooperative-sticky classic and
    KIP-848, revoke a partition before they assign it elsewhere, so no partition counts twice);
  - consumption part: of the records the trainer committed between two pushed positions, the fraction
    that were this producer's, averaged over about `1 / _WEIGHT` trainer steps (an EWMA that starts, at the
    first pushed position, from the partition part). Every producer applies the same positions, so these
    fractions sum to one (less what producers that left had published; a producer that applied other
    positions, e.g. one that joined between two, drifts from that by a fraction of a group, which shrinks by
    `_WEIGHT` each step); a fast producer's part grows while
    a slow one's shrinks, so a fast producer is not held for long at a share a slow one leaves unused. It
    is known only once a pushed position came: until then (and in ``poll`` mode, where each producer reads
    the lag at its own moments and the fractions would not add up) the share is the partition part alone,
    i.e. max_lag x owned / partitions. A rebalance moves consumption part with the partitions: each
    partition gained adds 1 / partitions to it, each lost takes as much away (it may go below zero; the
    share is then zero), so a rebalance leaves the sum as it was, and a producer joining a running fleet
    takes over consumption part from those whose partitions it gets.
- Shares that sum to max_lag keep the fleet live: each producer admits until it holds floor(share) + 1,
  so together they reach more than max_lag, which a trainer step of at most max_lag groups needs.
- A stall would deadlock that: a trainer waiting for a step's last groups commits nothing, so no
  producer's outstanding falls, and those that still have prompts may all be at their shares (the end of
  the prompts, or uneven producers). So once the committed offsets have not moved for a while (the gate's
  `stall_s`), a producer admits by its share of the *headroom* instead (`admits_in_stall`): the lag
  readings then only grow, so together the producers add at most max_lag - lag, and each gets a turn after
  every reading.
- A share below one group admits a prompt only while nothing of this producer's is outstanding (0 <=
  share): every producer still gets turns, each time the trainer commits what it published. The test is
  ``own <= share``, so the lag of the fleet's published groups is at most sum(floor(share)) <= max_lag,
  plus what was in flight when the last prompts started (at most every producer's concurrency).
- Groups of a producer that left (or crashed) are nobody's until the trainer takes them: for that while
  the lag may exceed the bound by what it left. The gate's fleet-wide rule (estimate <= max_lag) still
  holds them back then.

Loop-only (the gate's loop); `admits` and the figures are plain reads, safe from any thread.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping

_WEIGHT = 1 / 8  # the consumption part's EWMA weight per pushed position (about 8 trainer steps)


class FleetShare:
    """This producer's share of `max_lag` and its own outstanding groups (see the module docstring)."""

    def __init__(self, max_lag: int) -> None:
        self.max_lag = max_lag
        self.partitions = 0  # NS.prompts partitions (0: unknown: the share is the whole max_lag)
        self.owned = 0  # of them assigned to this producer
        self.consumed: float | None = None  # the consumption part (None before a pushed position)
        self._pending = 0  # produced, not acknowledged or refused yet
        self._acked: dict[int, collections.deque[int]] = {}  # partition -> own acknowledged offsets, ascending
        self._committed: dict[int, int] = {}  # the trainer group's committed offsets as last known
        self._pushed: dict[int, int] | None = None  # committed offsets of the last pushed position
        self._taken = 0  # own records the trainer committed, ever (counted when its commits become known)
        self._taken_at_push = 0  # ... as of the last pushed position
        self.advanced_at = time.monotonic()  # when the committed offsets last moved forward
        self.admits = True

    @property
    def share(self) -> float:
        """max_lag x this producer's fraction of it (the whole max_lag while the partitions are unknown)."""
        if self.partitions <= 0:
            return float(self.max_lag)
        owned = min(self.owned, self.partitions) / self.partitions
        if self.consumed is None:
            return self.max_lag * owned
        return max(0.0, self.max_lag * (owned + self.consumed) / 2)

    @property
    def outstanding(self) -> int:
        """Own records not committed by the trainer group (as far as this producer knows)."""
        return self._pending + sum(len(offsets) for offsets in self._acked.values())

    def set_partitions(self, partitions: int) -> None:
        self.partitions = partitions
        self._update()

    def set_owned(self, owned: int) -> None:
        if self.consumed is not None and self.partitions > 0:
            self.consumed += (owned - self.owned) / self.partitions  # the part moves with the partitions
        self.owned = owned
        self._update()

    def note_produced(self) -> None:
        self._pending += 1
        self._update()

    def note_delivered(self, partition: int, offset: int) -> None:
        """An own record the broker acknowledged at `partition`, `offset`."""
        self._pending = max(0, self._pending - 1)
        if offset >= self._committed.get(partition, 0):
            self._acked.setdefault(partition, collections.deque()).append(offset)
        else:
            self._taken += 1  # committed before its acknowledgement came
        self._update()

    def note_refused(self) -> None:
        """An own record the broker refused: it is on no partition."""
        self._pending = max(0, self._pending - 1)
        self._update()

    def note_committed(self, committed: Mapping[int, int], *, pushed: bool) -> None:
        """The trainer group's committed offsets (per partition; offsets behind what is known are ignored).
        `pushed`: they come from a trainer position, which every producer applies alike (the consumption
        part follows those only)."""
        for p, offset in committed.items():
            if offset <= self._committed.get(p, 0):
                continue
            self._committed[p] = offset
            self.advanced_at = time.monotonic()
            acked = self._acked.get(p)
            while acked and acked[0] < offset:  # acknowledgements come in offset order per partition
                acked.popleft()
                self._taken += 1
        if pushed:
            self._follow_consumption(committed)
        self._update()

    def _follow_consumption(self, committed: Mapping[int, int]) -> None:
        previous, self._pushed = self._pushed, dict(committed)
        if previous is None:  # the first: start from the partition part (what it would get without this one)
            if self.consumed is None:
                self.consumed = min(self.owned, self.partitions) / self.partitions if self.partitions > 0 else 1.0
            self._taken_at_push = self._taken
            return
        total = sum(max(0, offset - previous.get(p, 0)) for p, offset in committed.items())
        mine, self._taken_at_push = self._taken - self._taken_at_push, self._taken
        if total > 0:
            self.consumed = (1 - _WEIGHT) * (self.consumed or 0.0) + _WEIGHT * min(1.0, mine / total)

    def admits_in_stall(self, produced_since: int, lag: int) -> bool:
        """While the trainer commits nothing (a stall: waiting for groups, or in a long step), whether this
        producer may start a prompt: while what it produced since the lag `lag` was read is at most its
        fraction of the headroom, share / max_lag x (max_lag - lag). The committed offsets stand still then,
        so a later reading (another producer's) sees every earlier one's records: the fleet adds at most the
        headroom in all, and each producer with prompts still gets its turn after each reading."""
        if self.max_lag <= 0:
            return produced_since <= 0
        return produced_since <= self.share / self.max_lag * (self.max_lag - lag)

    def _update(self) -> None:
        self.admits = self.outstanding <= self.share
