"""The contiguous commit watermark of each prompt partition.

Groups finish out of order, but a Kafka commit is one offset per partition meaning "everything below
is done". So per partition we keep the offsets taken and not yet acknowledged; the committable offset
is the lowest of them (or one past the highest taken when none is outstanding). A prompt that was
taken but never acknowledged (dropped at shutdown, lost in a crash) holds the watermark below it, so
its prompt is generated again by whoever owns the partition next.

Each assignment of a partition gets a fresh generation number: an acknowledgement that arrives after
the partition was revoked (or revoked and assigned again) carries the old generation and is ignored,
because its offsets now belong to the bookkeeping of another owner.

Thread-safe: the intake thread assigns, takes and commits; the event loop acknowledges.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field


@dataclass
class _Partition:
    generation: int
    outstanding: set[int] = field(default_factory=set)
    next_offset: int | None = None
    committed: int | None = None

    def committable(self) -> int | None:
        if self.outstanding:
            return min(self.outstanding)
        return self.next_offset


class Watermarks:
    """Outstanding prompt offsets per partition, and what may be committed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[int, _Partition] = {}
        self._generations = itertools.count(1)

    def assign(self, partitions: list[int]) -> None:
        """Start fresh bookkeeping for newly assigned partitions."""
        with self._lock:
            for p in partitions:
                self._parts[p] = _Partition(generation=next(self._generations))

    def revoke(self, partitions: list[int]) -> dict[int, int]:
        """Drop bookkeeping of `partitions`; return the offsets still worth committing for them."""
        with self._lock:
            out: dict[int, int] = {}
            for p in partitions:
                part = self._parts.pop(p, None)
                if part is None:
                    continue
                offset = part.committable()
                if offset is not None and offset != part.committed:
                    out[p] = offset
            return out

    def owned(self) -> list[int]:
        """The partitions assigned now."""
        with self._lock:
            return sorted(self._parts)

    def take(self, partition: int, offset: int) -> int | None:
        """Record `offset` as taken; return the generation to acknowledge it with (None: not owned)."""
        with self._lock:
            part = self._parts.get(partition)
            if part is None:
                return None
            part.outstanding.add(offset)
            if part.next_offset is None or offset >= part.next_offset:
                part.next_offset = offset + 1
            return part.generation

    def taken_up_to(self, partition: int) -> int | None:
        """One past the highest offset taken from `partition` under its current assignment (None: none yet)."""
        with self._lock:
            part = self._parts.get(partition)
            return None if part is None else part.next_offset

    def is_current(self, partition: int, generation: int) -> bool:
        """Whether `partition` is still owned under `generation` (a buffered prompt may still start)."""
        with self._lock:
            part = self._parts.get(partition)
            return part is not None and part.generation == generation

    def ack(self, partition: int, offset: int, generation: int) -> bool:
        """Mark `offset` done (its group is acknowledged by the broker). False when no longer owned."""
        with self._lock:
            part = self._parts.get(partition)
            if part is None or part.generation != generation:
                return False
            part.outstanding.discard(offset)
            return True

    def committable(self) -> dict[int, int]:
        """Per owned partition, the offset to commit when it moved since the last `mark_committed`."""
        with self._lock:
            out = {}
            for p, part in self._parts.items():
                offset = part.committable()
                if offset is not None and offset != part.committed:
                    out[p] = offset
            return out

    def mark_committed(self, offsets: dict[int, int]) -> None:
        with self._lock:
            for p, offset in offsets.items():
                part = self._parts.get(p)
                if part is not None:
                    part.committed = offset

    def outstanding(self) -> int:
        """Prompts taken and not yet acknowledged, over all owned partitions."""
        with self._lock:
            return sum(len(part.outstanding) for part in self._parts.values())

    def settled(self) -> bool:
        """Nothing outstanding and every watermark committed."""
        with self._lock:
            return all(not part.outstanding and part.committable() in (None, part.committed)
                       for part in self._parts.values())
