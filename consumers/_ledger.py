"""Which step manifests of a consumer group count, rebuilt from NS.steps in log order, and what dedupe remembers.

The trainer writes a step's manifest *before* it commits the step's offsets, so a crash between the
two leaves a manifest whose offsets were never committed; the next run takes those offsets again
and writes a new manifest for them, under the same step number. One rule set decides which
manifests are *effective*; the consumer (dedupe, next step number) and the audit share it, so they
cannot disagree:

1. A manifest supersedes every earlier manifest of the group with the same or a higher step number
   (the step was taken again: its first manifest was never committed, or the trainer went back to a
   checkpoint with `seek_to(..., next_step=K)`).
2. A manifest supersedes every earlier manifest that reaches, on some partition, past where the new
   one starts (the trainer's position went back: `seek_to` an older checkpoint).
   Rules 1 and 2 do not apply to a *rewrite*: a manifest identical in step, ranges and taken groups to
   one already counted (a recorded step taken again as it was, see `rollstream.consumers._resume`) supersedes
   only that one, so the recorded steps after it stay and are taken again as they were too.
3. After all manifests are read, a manifest whose ranges go past the group's committed offsets was
   never committed (crash between manifest and commit); it is pending, not effective, and its groups
   are not "taken" for dedupe: they will be taken again.

The group ids taken in effective steps are what dedupe skips. Requeues are remembered from every
manifest read, effective or not (a requeue record, once published, stays on NS.prompts): the highest
attempt each group's prompt was requeued as, so the same attempt is not requeued twice.

**The dedupe window** (`DedupeWindow`, the consumer's default): a streaming run is one long epoch, so
remembering every id would grow by ~20 bytes per group for ever (~130 as Python strs; see below). What can
come back is bounded: a group id is the prompt's id and epoch (`make_group_id`, the same for every attempt),
records are keyed by it, so a re-generated group (a producer killed between publishing and committing its
prompt, a drain that timed out, a trainer that requeued twice across a crash) lands on its original's
partition, *after* it, once a session timeout, a drain and a generation have passed. So the ledger forgets,
per partition, the ids a step took there once both hold: the window's position on that partition is `offsets`
or more past the step's end there, and the step was written (its manifest's ``created_at_ms``) `seconds` or
more before the newest committed step. The position is the furthest end of a committed step, never past the
committed offsets (during a rebuild pending manifests move nothing) and moved back by `rewind`; a take only
looks at offsets at or after it. Hence the guarantee, live and after any restart:

    a group whose id was taken at offset o of partition p is skipped as a duplicate at offset d of p
    whenever d - o <= offsets, or the trainer looks at it less than `seconds` after the step that took
    it was written.

The requeue attempts, and the offsets a timed-out take requeued, are forgotten by the same rule, counted from
the stale group's offset and the manifest that recorded the requeue. A step out of the window on every
partition is dropped whole (the next step number survives it). Memory: about ``max(offsets x partitions,
groups/s x seconds)`` ids of ~20 bytes: an id is kept as its 64-bit digest with the part (step and partition)
holding it, in `rollstream.consumers._digests.TakenDigests` (12 bytes), and a step as one compact table (~250
bytes with 3 partitions); `tests/bench/ledger_memory.py` measures it. A `seek_to` further back than the window
may need ids already forgotten: `forgot_within` says so, and the consumer then rebuilds its ledger from the
manifests. Without a window (``window=None``: the audit's ledgers) everything is kept. Optionally also bounded
by epoch: with ``dedupe_epochs=E``, ids of epochs older than (newest epoch seen - E) are forgotten.

The ledger is the one owner of "taken" on the trainer side: besides the effective steps it holds the
ids of groups taken and not committed yet (in the take under way, or in batches taken with
``commit=False``): `hold` when a group is taken, `release` when its step is committed (then `add`ed)
or put back. Held ids are never forgotten.
"""

from __future__ import annotations

from array import array
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count

from rollstream.consumers._digests import TakenDigests, digest_of
from rollstream.schemas import ConfigError, StepManifest


@dataclass(frozen=True)
class DedupeWindow:
    """How far back the trainer's dedupe remembers taken group ids (see `rollstream.consumers._ledger`).

    An id is forgotten once *both* bounds are passed, so a duplicate is skipped when either holds.
    Size them by what can come back: `offsets` >= the records a partition receives while a killed
    producer's prompt moves on and is generated again (session timeout, ``--drain-on-revoke``, the longest
    generation, the backlog the gates allow); `seconds` >= that delay in time. Memory: ~20 bytes per id
    remembered (25 MB per million by tracemalloc, 64-group steps), about ``max(offsets x partitions,
    groups/s x seconds)`` ids. The defaults: the hour covers a session timeout, a drain and generations of tens
    of minutes; the 20,000 records cover a trainer that was down for longer (its clock jumped) while the gates
    held the backlog; at the capacity plan's 370 groups/s on 64 partitions both come to ~1.3 M ids, ~35 MB.

    Attributes:
        offsets: records per partition past the end of the step that took an id (>= 0).
        seconds: trainer time since that step was written, by the manifests' ``created_at_ms`` (>= 0).
    """

    offsets: int = 20_000
    seconds: float = 3600.0

    def __post_init__(self) -> None:
        if self.offsets < 0 or self.seconds < 0:
            raise ConfigError(f"DedupeWindow(offsets={self.offsets}, seconds={self.seconds}): both must be >= 0; "
                              "pass dedupe_window=None to remember every taken group id")


DEFAULT_DEDUPE_WINDOW = DedupeWindow()  # frozen: the consumer's default


_COLUMNS = 5  # a `_Step.table` row: partition, start, end, part, size


@dataclass(eq=False, slots=True)
class _Step:
    """One effective step, compact: a long window holds tens of thousands (~250 bytes each with 3 partitions)."""

    step: int
    table: array[int]  # a row per partition: partition, start, end, and the `TakenDigests` part and size of
    # the ids it took there (part -1: none, or forgotten)
    digest: int  # hash of the taken ids in order: a rewrite (same step and ranges) has the same
    newest_epoch: int | None
    created_ms: int
    manifest: StepManifest | None = field(default=None, repr=False)
    serial: int = 0
    open_parts: int = 0  # partitions the window has not forgotten yet
    alive: bool = True

    @property
    def bounds(self) -> dict[int, tuple[int, int]]:
        """[start, end) per partition."""
        t = self.table
        return {t[i]: (t[i + 1], t[i + 2]) for i in range(0, len(t), _COLUMNS)}

    def end_on(self, partition: int) -> int:
        """Where this step ends on `partition` (one it covers)."""
        return self.table[self._row(partition) + 2]

    def covers(self, partition: int) -> bool:
        return partition in self.table[::_COLUMNS]

    def held_partitions(self) -> list[int]:
        """The partitions whose taken ids the step still holds."""
        t = self.table
        return [t[i] for i in range(0, len(t), _COLUMNS) if t[i + 3] >= 0]

    def pop_part(self, partition: int) -> tuple[int, int] | None:
        """The part and size of the ids taken on `partition`, once (None: none, or popped already)."""
        if not self.covers(partition):
            return None
        row = self._row(partition)
        part, size = self.table[row + 3], self.table[row + 4]
        self.table[row + 3] = -1
        return None if part < 0 else (part, size)

    def reaches_past(self, offsets: Mapping[int, int | None]) -> bool:
        """True when on some partition this step ends after `offsets` (None: nothing there)."""
        for p, (_, end) in self.bounds.items():
            limit = offsets.get(p)
            if limit is None or end > limit:
                return True
        return False

    def _row(self, partition: int) -> int:
        return self.table[::_COLUMNS].index(partition) * _COLUMNS


@dataclass(frozen=True)
class DroppedStep:
    """A step that `StepLedger.add` superseded or `drop_uncommitted` found pending.

    Attributes:
        step: its step number.
        manifest: its manifest (only with ``keep_manifests=True``, else None).
    """

    step: int
    manifest: StepManifest | None = None


@dataclass(frozen=True)
class _Requeued:
    attempt: int
    partition: int
    offset: int  # of the stale group whose prompt was requeued
    created_ms: int  # of the manifest that recorded it (the newest committed one for a note before it)
    early: bool = False  # published by a take that timed out (`requeued_from`)


def epoch_of(group_id: str) -> int | None:
    """The epoch encoded in a `make_group_id` id (``prompt#epoch``), or None for other ids."""
    _, sep, tail = group_id.rpartition("#")
    return int(tail) if sep and tail.isdigit() else None


class StepLedger:
    """The effective steps of one consumer group and the group ids they took. Not thread-safe.

    Args:
        keep_manifests: keep the full manifests (the audit needs their dispositions; the consumer
            does not, and keeps only ranges and taken ids). Never forgets (no window).
        dedupe_epochs: forget taken ids of epochs older than the newest seen minus this (None: keep all).
        window: forget taken ids out of this window (None: keep all).
        committed: while rebuilding at a start, the group's committed offsets: manifests past them are
            pending and do not move the window; `drop_uncommitted` ends the rebuild.
        remember_ids: False: remember no taken id (`is_taken` is then False for all but held ids): for a
            reader that needs only which steps count (export's first pass over a long history).
    """

    def __init__(self, *, keep_manifests: bool = False, dedupe_epochs: int | None = None,
                 window: DedupeWindow | None = None, committed: Mapping[int, int | None] | None = None,
                 remember_ids: bool = True) -> None:
        self._steps: dict[int, _Step] = {}  # by serial, in the order added (log order)
        self._serials = count()
        self._taken = TakenDigests()  # the ids the steps took (their tables' parts)
        self._held: Counter[str] = Counter()
        self._requeued: dict[str, _Requeued] = {}
        self._requeued_from: set[tuple[int, int]] = set()  # offsets whose requeue a timed-out take published
        self._keep = keep_manifests
        self._remember_ids = remember_ids
        self._dedupe_epochs = dedupe_epochs
        self._newest_epoch: int | None = None
        self._epoch_queue: deque[_Step] = deque()  # steps whose ids the epoch bound has not forgotten yet
        self._window = None if keep_manifests else window
        self._limit = None if committed is None else dict(committed)
        self._front: dict[int, int] = {}  # per partition, the committed position the window counts from
        self._newest_ms = 0  # created_at_ms of the newest committed manifest
        self._trail: dict[int, deque[_Step]] = {}  # per partition, steps in log order, until forgotten there
        self._requeue_trail: dict[int, deque[tuple[str, _Requeued]]] = {}
        self._floor_step = -1  # the highest step number dropped whole by the window
        self._forgotten_upto: dict[int, int] = {}  # per partition, the furthest end of what the window forgot
        self._reach: dict[int, int] = {}  # per partition, >= the end of every step held (fast path of `add`)
        self._top_step = -1  # >= every step number held

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def remembered(self) -> int:
        """Taken group ids remembered for dedupe (effective steps, not the held ones)."""
        return len(self._taken)

    @property
    def next_step(self) -> int:
        """One past the highest effective step number (0 when there is none)."""
        return max(max((s.step for s in self._steps.values()), default=-1), self._floor_step) + 1

    def is_taken(self, group_id: str) -> bool:
        """True when `group_id` was taken in an effective step, or is held by a step not committed yet."""
        return digest_of(group_id) in self._taken or group_id in self._held

    def requeued_as(self, group_id: str) -> int:
        """The highest attempt `group_id`'s prompt was requeued as (0: never)."""
        found = self._requeued.get(group_id)
        return 0 if found is None else found.attempt

    def note_requeued(self, group_id: str, attempt: int, partition: int, offset: int, *, early: bool = False,
                      created_ms: int | None = None) -> None:
        """`group_id`'s prompt was published again as `attempt`, for the stale group at `offset` of `partition`;
        `early`: by a take that then timed out (no step records it yet, `requeued_from`)."""
        note = _Requeued(attempt, partition, offset, self._newest_ms if created_ms is None else created_ms, early)
        known = self._requeued.get(group_id)
        if known is None or attempt >= known.attempt:
            self._requeued[group_id] = note
        if early:
            self._requeued_from.add((partition, offset))
        if self._window is not None:
            self._requeue_trail.setdefault(partition, deque()).append((group_id, note))

    def requeued_from(self, partition: int, offset: int) -> bool:
        """Whether a timed-out take already requeued the group at `offset` of `partition`."""
        return (partition, offset) in self._requeued_from

    def hold(self, group_ids: Iterable[str]) -> None:
        """Mark `group_ids` taken by a step that is not committed yet (`is_taken` is True for them)."""
        self._held.update(group_ids)

    def release(self, group_ids: Iterable[str] | None = None) -> None:
        """Undo `hold` for `group_ids` (their step was committed and `add`ed, or put back); None: all."""
        if group_ids is None:
            self._held.clear()
            return
        self._held.subtract(group_ids)
        self._held = +self._held  # drop the ids whose count reached 0

    def effective(self) -> list[StepManifest]:
        """The effective manifests in log order (only with ``keep_manifests=True``)."""
        return [s.manifest for s in self._steps.values() if s.manifest is not None]

    def add(self, manifest: StepManifest, *, keep: StepManifest | None = None) -> list[DroppedStep]:
        """Apply `manifest` (rules 1 and 2); return the steps it superseded. Then forget what left the window.
        `keep`: what `effective` and `DroppedStep` give for this step instead of `manifest` (with
        ``keep_manifests=True``), e.g. the manifest without its dispositions, when only its ranges are needed."""
        starts = {r.partition: r.start for r in manifest.ranges}
        bounds = {r.partition: (r.start, r.end) for r in manifest.ranges}
        taken = [(d.partition, d.group_id) for d in manifest.dispositions
                 if d.kind == "taken" and d.group_id is not None]
        for d in manifest.dispositions:
            if d.kind == "requeued" and d.group_id is not None:
                self.note_requeued(d.group_id, d.attempt + 1, d.partition, d.offset,
                                   created_ms=manifest.created_at_ms)
        ids = tuple(gid for _, gid in taken)
        superseded = self._superseded(manifest.step, bounds, hash(ids), starts)
        self._remove(superseded)
        parts: dict[int, list[str]] = {}
        for p, gid in taken:
            parts.setdefault(p, []).append(gid)
        epochs = [e for gid in ids if (e := epoch_of(gid)) is not None]
        table = array("q")
        for p, (start, end) in bounds.items():
            held = p in parts and self._remember_ids
            table.extend((p, start, end, *(self._taken.add(parts[p]) if held else (-1, 0))))
        step = _Step(manifest.step, table, hash(ids),
                     max(epochs, default=None), manifest.created_at_ms,
                     (keep or manifest) if self._keep else None,
                     next(self._serials), len(bounds))
        self._steps[step.serial] = step
        if self._dedupe_epochs is not None:
            self._epoch_queue.append(step)
        self._floor_step = min(self._floor_step, step.step - 1)  # rule 1 superseded any dropped step >= it
        self._top_step = max(self._top_step, step.step)
        for p, (_, end) in bounds.items():
            self._reach[p] = max(self._reach.get(p, end), end)
            self._trail.setdefault(p, deque()).append(step)
        if step.newest_epoch is not None and (self._newest_epoch is None or step.newest_epoch > self._newest_epoch):
            self._newest_epoch = step.newest_epoch
        self._advance(step)
        self._prune()
        return [DroppedStep(s.step, s.manifest) for s in superseded]

    def drop_uncommitted(self, committed: Mapping[int, int | None]) -> list[DroppedStep]:
        """Rule 3: remove steps that go past the committed offsets; return them (pending manifests). Ends a
        rebuild: from now on every step added is committed."""
        pending = [s for s in self._steps.values() if s.reaches_past(committed)]
        self._remove(pending)
        self._limit = None
        return [DroppedStep(s.step, s.manifest) for s in pending]

    def rewind(self, positions: Mapping[int, int]) -> list[int]:
        """The trainer's position moved back to `positions`: forget steps past it; return their numbers. The
        window then counts from `positions` (see `forgot_within` for what it may have forgotten already)."""
        dropped = [s for s in self._steps.values()
                   if any(end > positions.get(p, end) for p, (_, end) in s.bounds.items())]
        self._remove(dropped)
        for p, o in positions.items():
            if p in self._front:
                self._front[p] = min(self._front[p], o)
        return [s.step for s in dropped]

    def forgot_within(self, positions: Mapping[int, int]) -> bool:
        """Whether the window already forgot ids that it would still remember at `positions` (a seek back
        further than the window): a ledger rebuilt for `positions` then remembers more than this one."""
        window = self._window
        if window is None:
            return False
        forgotten = self._forgotten_upto
        return any(p in forgotten and forgotten[p] + window.offsets > o for p, o in positions.items())

    def _superseded(self, step: int, bounds: dict[int, tuple[int, int]], digest: int,
                    starts: Mapping[int, int]) -> list[_Step]:
        """The steps a manifest of `step` over `bounds` supersedes (rules 1 and 2, or its rewrite's twin)."""
        if step > self._top_step and all(start >= self._reach.get(p, start) for p, start in starts.items()):
            return []  # the usual case, in O(partitions): a step after every one held supersedes none
        held = list(self._steps.values())
        twins = [s for s in held if s.step == step and s.bounds == bounds and s.digest == digest]
        return twins or [s for s in held if s.step >= step or _overlaps(s, starts)]

    def _advance(self, step: _Step) -> None:
        """Move the window's position and clock to a committed `step` (a pending one moves nothing)."""
        if self._limit is not None and step.reaches_past(self._limit):
            return
        for p, (_, end) in step.bounds.items():
            self._front[p] = max(self._front.get(p, end), end)
        self._newest_ms = max(self._newest_ms, step.created_ms)

    def _remove(self, steps: Iterable[_Step]) -> None:
        gone = [s for s in steps if s.alive]
        if not gone:
            return
        for s in gone:
            self._forget_ids(s, *s.held_partitions())
            s.alive = False
            del self._steps[s.serial]
        for p in {p for s in gone for p in s.table[::_COLUMNS]}:
            self._trail[p] = deque(s for s in self._trail[p] if s.alive)
        self._epoch_queue = deque(s for s in self._epoch_queue if s.alive)
        self._reach = {}
        for s in self._steps.values():
            for p, (_, end) in s.bounds.items():
                self._reach[p] = max(self._reach.get(p, end), end)
        self._top_step = max((s.step for s in self._steps.values()), default=-1)

    def _forget_ids(self, step: _Step, *partitions: int) -> None:
        for p in partitions:
            part = step.pop_part(p)
            if part is not None:  # each step lets go of its ids once, whichever bound forgets them first
                self._taken.drop(*part)

    def _prune(self) -> None:
        if self._dedupe_epochs is not None and self._newest_epoch is not None:
            horizon = self._newest_epoch - self._dedupe_epochs
            while self._epoch_queue:
                s = self._epoch_queue[0]
                if s.alive and (s.newest_epoch is None or s.newest_epoch >= horizon):
                    break
                self._epoch_queue.popleft()
                self._forget_ids(s, *s.held_partitions())
        if self._window is not None:
            self._slide(self._window)

    def _slide(self, window: DedupeWindow) -> None:
        """Forget, per partition, what left `window`: the oldest steps first, then the oldest requeues."""
        horizon_ms = self._newest_ms - int(window.seconds * 1000)
        for p, trail in self._trail.items():
            front = self._front.get(p)
            while trail and front is not None and (
                    not trail[0].alive
                    or (front - trail[0].end_on(p) >= window.offsets and trail[0].created_ms <= horizon_ms)):
                s = trail.popleft()
                if s.alive:
                    self._forget_part(s, p)
        for p, notes in self._requeue_trail.items():
            front = self._front.get(p)
            while notes and front is not None and (
                    front - (notes[0][1].offset + 1) >= window.offsets and notes[0][1].created_ms <= horizon_ms):
                gid, note = notes.popleft()
                if self._requeued.get(gid) is note:
                    del self._requeued[gid]
                if note.early:
                    self._requeued_from.discard((p, note.offset))

    def _forget_part(self, step: _Step, partition: int) -> None:
        self._forget_ids(step, partition)
        self._forgotten_upto[partition] = max(self._forgotten_upto.get(partition, -1), step.end_on(partition))
        step.open_parts -= 1
        if step.open_parts == 0:  # out of the window everywhere: only its step number is still needed
            step.alive = False
            del self._steps[step.serial]
            self._floor_step = max(self._floor_step, step.step)


def _overlaps(step: _Step, starts: Mapping[int, int]) -> bool:
    return any(step.covers(p) and step.end_on(p) > start for p, start in starts.items())
