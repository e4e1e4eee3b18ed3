"""Which step manifests of a consumer group count, rebuilt from NS.steps in log order.

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
attempt each group's prompt was requeued as, so the same attempt is not requeued twice. Optionally
bounded by epoch: with ``dedupe_epochs=E``, ids of epochs older than (newest epoch seen - E) are forgotten.

The ledger is the one owner of "taken" on the trainer side: besides the effective steps it holds the
ids of groups taken and not committed yet (in the take under way, or in batches taken with
``commit=False``): `hold` when a group is taken, `release` when its step is committed (then `add`ed)
or put back.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from rollstream.schemas import StepManifest


@dataclass
class _Step:
    step: int
    bounds: dict[int, tuple[int, int]]
    taken: tuple[str, ...]
    newest_epoch: int | None
    manifest: StepManifest | None = field(default=None, repr=False)

    def reaches_past(self, offsets: Mapping[int, int | None]) -> bool:
        """True when on some partition this step ends after `offsets` (None: nothing there)."""
        for p, (_, end) in self.bounds.items():
            limit = offsets.get(p)
            if limit is None or end > limit:
                return True
        return False


@dataclass(frozen=True)
class DroppedStep:
    """A step that `StepLedger.add` superseded or `drop_uncommitted` found pending.

    Attributes:
        step: its step number.
        manifest: its manifest (only with ``keep_manifests=True``, else None).
    """

    step: int
    manifest: StepManifest | None = None


def epoch_of(group_id: str) -> int | None:
    """The epoch encoded in a `make_group_id` id (``prompt#epoch``), or None for other ids."""
    _, sep, tail = group_id.rpartition("#")
    return int(tail) if sep and tail.isdigit() else None


class StepLedger:
    """The effective steps of one consumer group and the group ids they took. Not thread-safe.

    Args:
        keep_manifests: keep the full manifests (the audit needs their dispositions; the consumer
            does not, and keeps only ranges and taken ids).
        dedupe_epochs: forget taken ids of epochs older than the newest seen minus this (None: keep all).
    """

    def __init__(self, *, keep_manifests: bool = False, dedupe_epochs: int | None = None) -> None:
        self._steps: list[_Step] = []
        self._taken: dict[str, int] = {}
        self._held: Counter[str] = Counter()
        self._requeued: dict[str, int] = {}
        self._requeued_from: set[tuple[int, int]] = set()  # offsets whose requeue a timed-out take published
        self._keep = keep_manifests
        self._dedupe_epochs = dedupe_epochs
        self._newest_epoch: int | None = None
        self._pruned = 0

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def next_step(self) -> int:
        """One past the highest effective step number (0 when there is none)."""
        return max((s.step for s in self._steps), default=-1) + 1

    def is_taken(self, group_id: str) -> bool:
        """True when `group_id` was taken in an effective step, or is held by a step not committed yet."""
        return group_id in self._taken or group_id in self._held

    def requeued_as(self, group_id: str) -> int:
        """The highest attempt `group_id`'s prompt was requeued as (0: never)."""
        return self._requeued.get(group_id, 0)

    def note_requeued(self, group_id: str, attempt: int, where: tuple[int, int] | None = None) -> None:
        """`group_id`'s prompt was published again as `attempt`; `where`: for the group at that (partition,
        offset), by a take that then timed out (no step records it yet)."""
        self._requeued[group_id] = max(attempt, self._requeued.get(group_id, 0))
        if where is not None:
            self._requeued_from.add(where)

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
        return [s.manifest for s in self._steps if s.manifest is not None]

    def add(self, manifest: StepManifest) -> list[DroppedStep]:
        """Apply `manifest` (rules 1 and 2); return the steps it superseded."""
        starts = {r.partition: r.start for r in manifest.ranges}
        bounds = {r.partition: (r.start, r.end) for r in manifest.ranges}
        taken = tuple(d.group_id for d in manifest.dispositions if d.kind == "taken" and d.group_id is not None)
        for d in manifest.dispositions:
            if d.kind == "requeued" and d.group_id is not None:
                self.note_requeued(d.group_id, d.attempt + 1)
        twins = [s for s in self._steps if s.step == manifest.step and s.bounds == bounds and s.taken == taken]
        superseded = twins or [s for s in self._steps if s.step >= manifest.step or _overlaps(s, starts)]
        self._remove(superseded)
        epochs = [e for gid in taken if (e := epoch_of(gid)) is not None]
        step = _Step(manifest.step, bounds, taken, max(epochs, default=None), manifest if self._keep else None)
        self._steps.append(step)
        for gid in taken:
            self._taken[gid] = step.step
        if step.newest_epoch is not None and (self._newest_epoch is None or step.newest_epoch > self._newest_epoch):
            self._newest_epoch = step.newest_epoch
        self._prune()
        return [DroppedStep(s.step, s.manifest) for s in superseded]

    def drop_uncommitted(self, committed: Mapping[int, int | None]) -> list[DroppedStep]:
        """Rule 3: remove steps that go past the committed offsets; return them (pending manifests)."""
        pending = [s for s in self._steps if s.reaches_past(committed)]
        self._remove(pending)
        return [DroppedStep(s.step, s.manifest) for s in pending]

    def rewind(self, positions: Mapping[int, int]) -> list[int]:
        """The trainer's position moved back to `positions`: forget steps past it; return their numbers."""
        dropped = [s for s in self._steps if any(end > positions.get(p, end) for p, (_, end) in s.bounds.items())]
        self._remove(dropped)
        return [s.step for s in dropped]

    def _remove(self, steps: Iterable[_Step]) -> None:
        gone = {id(s) for s in steps}
        if not gone:
            return
        for s in self._steps:
            if id(s) in gone:
                for gid in s.taken:
                    if self._taken.get(gid) == s.step:
                        del self._taken[gid]
        self._steps = [s for s in self._steps if id(s) not in gone]
        self._pruned = min(self._pruned, len(self._steps))

    def _prune(self) -> None:
        if self._dedupe_epochs is None or self._newest_epoch is None:
            return
        horizon = self._newest_epoch - self._dedupe_epochs
        while self._pruned < len(self._steps):
            s = self._steps[self._pruned]
            if s.newest_epoch is None or s.newest_epoch >= horizon:
                return
            for gid in s.taken:
                if self._taken.get(gid) == s.step:
                    del self._taken[gid]
            s.taken = ()
            self._pruned += 1


def _overlaps(step: _Step, starts: Mapping[int, int]) -> bool:
    return any(p in step.bounds and step.bounds[p][1] > start for p, start in starts.items())
