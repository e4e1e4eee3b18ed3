"""The contiguous commit watermark of each prompt partition, and which of its prompts were started.

Groups finish out of order, but a Kafka commit is one offset per partition meaning "everything below
is done". So per partition we keep the offsets taken and not yet acknowledged; the committable offset
is the lowest of them (or one past the highest taken when none is outstanding). A prompt that was
taken but never acknowledged (dropped at shutdown, lost in a crash) holds the watermark below it, so
its prompt is generated again by whoever owns the partition next.

A taken prompt is first only *queued* (handed over, waiting for the loop); `start` marks it *started*
when the loop takes it to generate, atomically with the check that its partition is still owned and
not draining. `drain` (a revocation) stops further starts in its partitions and waits, on a condition
that `ack` signals, until every started prompt there is acknowledged; queued prompts are abandoned
(left uncommitted, so the next owner takes them and nothing is generated twice).

Each assignment of a partition gets a fresh generation number: an acknowledgement that arrives after
the partition was revoked (or revoked and assigned again) carries the old generation and is ignored,
because its offsets now belong to the bookkeeping of another owner.

`commit_partitions` commits them synchronously (a revocation; on the intake thread only); the intake's other
commits are asynchronous (`rollstream.producers._intake_commits`).

Thread-safe: the intake thread assigns, takes, drains and commits; the event loop starts and
acknowledges (each only takes the lock briefly and, for `ack`, notifies: never a wait on the loop).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import Consumer
from rollstream.infra.kafka_errors import CommitFailed
from rollstream.infra.kafka_io import commit_offsets

log = logging.getLogger(__name__)


@dataclass
class _Partition:
    generation: int
    outstanding: set[int] = field(default_factory=set)  # taken, not acknowledged (queued or started)
    started: set[int] = field(default_factory=set)  # the outstanding ones the loop started
    draining: bool = False  # being revoked: nothing more starts
    next_offset: int | None = None
    committed: int | None = None

    def committable(self) -> int | None:
        if self.outstanding:
            return min(self.outstanding)
        return self.next_offset


@dataclass(frozen=True)
class Drain:
    """What a drain of revoked partitions did.

    Attributes:
        finished: started prompts acknowledged while the drain waited.
        unfinished: started prompts still unacknowledged when it returned (timeout or stop): their
            groups are still published, and the next owner generates them again (duplicates, no loss).
        abandoned: prompts taken but never started: left uncommitted for the next owner.
        waited_s: how long the drain took.
    """

    finished: int
    unfinished: int
    abandoned: int
    waited_s: float


class Watermarks:
    """Outstanding prompt offsets per partition, and what may be committed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified by `ack` and `wake`
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

    def drain(self, partitions: list[int], timeout_s: float, stopping: Callable[[], bool]) -> Drain:
        """Stop starts in `partitions`, then wait until each prompt started there is acknowledged.

        Blocks the calling thread (never call it on the loop) up to `timeout_s`, or until `stopping()`
        is true when checked (at the start and at each `ack` or `wake`). The partitions stay owned:
        `revoke` them afterwards to commit what is contiguous.
        """
        began = time.monotonic()
        deadline = began + timeout_s
        with self._changed:
            parts = [self._parts[p] for p in partitions if p in self._parts]
            for part in parts:
                part.draining = True
            before = left = sum(len(part.started) for part in parts)
            while left and not stopping():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
                left = sum(len(part.started) for part in parts)
            abandoned = sum(len(part.outstanding - part.started) for part in parts)
        return Drain(before - left, left, abandoned, time.monotonic() - began)

    def wake(self) -> None:
        """Make a waiting `drain` re-check its `stopping` condition now."""
        with self._changed:
            self._changed.notify_all()

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
        """Whether `partition` is still owned under `generation` (a started prompt may still run)."""
        with self._lock:
            part = self._parts.get(partition)
            return part is not None and part.generation == generation

    def start(self, partition: int, offset: int, generation: int) -> bool:
        """Mark a taken prompt started, if its partition is still owned under `generation` and not
        draining; False: it must not start (the partition's next owner takes it)."""
        with self._lock:
            part = self._parts.get(partition)
            if part is None or part.generation != generation or part.draining or offset not in part.outstanding:
                return False
            part.started.add(offset)
            return True

    def ack(self, partition: int, offset: int, generation: int) -> bool:
        """Mark `offset` done (its group is acknowledged by the broker). False when no longer owned."""
        with self._changed:
            part = self._parts.get(partition)
            if part is None or part.generation != generation:
                return False
            part.outstanding.discard(offset)
            if part.draining and offset in part.started:
                self._changed.notify_all()
            part.started.discard(offset)
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

    def known(self) -> dict[int, int]:
        """Per owned partition, the offset that may be committed now, moved or not (None known: left out):
        what a commit that only refreshes the commit metadata may write without skipping a prompt."""
        with self._lock:
            return {p: offset for p, part in self._parts.items() if (offset := part.committable()) is not None}

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


def commit_partitions(consumer: Consumer, topic: str, group_id: str, offsets: dict[int, int], *,
                      metadata: str | None = None) -> dict[int, int]:
    """Commit `offsets` (each with `metadata`); return those of the partitions that failed (to retry). Blocks;
    intake thread only. Raises CommitFailed when librdkafka calls the failure fatal."""
    try:
        commit_offsets(consumer, topic, offsets, metadata=metadata)
    except CommitFailed as exc:
        if exc.fatal:
            raise
        failed = {p: offsets[p] for p in exc.failed if p in offsets}
        for p, offset in failed.items():
            log.warning("commit of %s[%d]@%d for group %s failed (will retry): %s", topic, p, offset, group_id,
                        exc.failed[p])
        return failed
    log.debug("committed %s offsets %s for group %s", topic, offsets, group_id)
    return {}
