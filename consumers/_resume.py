"""Where a consumer group stands after a start or `seek_to_step`, and the recorded steps it takes again as they were.

Every step's manifest is on NS.steps before its batch is handed to the trainer (`RolloutConsumer.take`
writes it, then commits the offsets with ``commit=True`` or later in `commit`). So a step that was
handed over but never committed is still *recorded*: which offsets it looked at, in which order, and
which groups it took. A restarted consumer takes those recorded steps again first, each as the very
same batch (ids, order, step number), before it takes anything new; `seek_to_step` does the same for
the steps after a trainer checkpoint. Without this, which partition's records arrive first would
decide a rebuilt batch, and with several partitions it would almost never be the same.

A recorded step is taken again only while the steps chain: each starts, on every partition it
touches, at or after where the previous one ended. The first that does not (or whose records are gone,
or that took other than the n a take asks for, or, judged by `RolloutConsumer`, took a group that is stale
now: an older trainer run's) ends the redo; from there on, groups are taken afresh
(nothing is lost: the offsets were not committed).

`Restart` works out where the group stands (`Standing`): at a start, from the committed offsets (else each
partition's start) and the group's manifests, read where the commits' `ManifestIndex` says (the ledger of
effective steps rebuilds dedupe and the next step number, see `rollstream.consumers._ledger`; a step past
the committed offsets was never committed and is taken again first); at `seek_to_step(k)`, from the steps
up to k. It changes no state of the consumer's: `RolloutConsumer` installs the standing (its position,
ledger and step numbers stay its own) and `Restart` keeps only the queue of recorded steps to take again.
Every read spends the `Deadline` of the consumer's call that needs it (a take, a seek): the reads of a start
together, never each a timeout of its own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer
from rollstream.consumers._batch import Batch
from rollstream.consumers._ledger import DedupeWindow, StepLedger
from rollstream.consumers._manifests import ManifestIndex, ManifestRead, read_group_manifests
from rollstream.consumers.forensics._replay import read_taken
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_io import committed_with_metadata, partitions_of, watermarks
from rollstream.schemas import RollstreamError, StepManifest

log = logging.getLogger(__name__)


def latest_by_step(manifests: Iterable[StepManifest], steps: Iterable[int]) -> list[StepManifest]:
    """For each of `steps`, the last manifest with that step number in log order; in step order."""
    last = {m.step: m for m in manifests}
    return [last[s] for s in sorted(set(steps)) if s in last]


def chained(manifests: Sequence[StepManifest], position: Mapping[int, int]) -> list[StepManifest]:
    """The leading `manifests` (by step number) that continue back to back from `position`.

    `position` is, per partition, the next offset to look at. A manifest continues when none of its
    ranges starts before that partition's position; the position then moves to its range ends.
    """
    at = dict(position)
    out: list[StepManifest] = []
    ordered = sorted(manifests, key=lambda m: m.step)
    for m in ordered:
        behind = [r for r in m.ranges if r.start < at.get(r.partition, 0)]
        if behind:
            r = behind[0]
            log.warning("recorded steps %s are not taken again as recorded: step %d starts at %s[%d]@%d, before "
                        "the position %d; taking afresh from there", [x.step for x in ordered[len(out):]], m.step,
                        m.topic, r.partition, r.start, at.get(r.partition, 0))
            break
        out.append(m)
        at.update({r.partition: r.end for r in m.ranges})
    return out


def position_after(upto: Sequence[StepManifest], later: Sequence[StepManifest],
                   current: Mapping[int, int]) -> dict[int, int]:
    """Per partition of `current`, the next offset to look at right after the steps `upto`.

    The end of the last of `upto` touching the partition; else where the first of `later` touching it
    starts; else the partition's `current` position (no recorded step ever looked at it).
    """
    out = dict(current)
    for p in current:
        ends = [r.end for m in upto for r in m.ranges if r.partition == p]
        starts = [r.start for m in later for r in m.ranges if r.partition == p]
        if ends:
            out[p] = max(ends)
        elif starts:
            out[p] = min(starts)
    return out


@dataclass(frozen=True)
class Standing:
    """Where a consumer group stands after a start or `seek_to_step`: what `RolloutConsumer` installs.

    Attributes:
        position: per partition of NS.rollouts, the next offset to look at.
        ledger: the group's effective steps up to `position` (dedupe, requeues); the consumer's from then on.
        next_step: the step number the next take gets.
        redo: the recorded steps to take again first, in order (they chain from `position`).
        index: where the group's manifests are on NS.steps (None: not known, or no manifests).
    """

    position: dict[int, int]
    ledger: StepLedger
    next_step: int
    redo: tuple[StepManifest, ...]
    index: ManifestIndex | None


class Restart:
    """Works out where `group_id` stands after a start or `seek_to_step`, and holds the recorded steps to take
    again (the one owner of that queue). Not thread-safe, like its owner."""

    def __init__(self, names: TopicNames, group_id: str, *, manifests: bool, dedupe_epochs: int | None,
                 dedupe_window: DedupeWindow | None) -> None:
        self.names, self.group_id = names, group_id
        self._manifests = manifests
        self._dedupe_epochs = dedupe_epochs
        self._dedupe_window = dedupe_window
        self._redo: deque[StepManifest] = deque()  # recorded steps to take again first, in order

    @property
    def redoing(self) -> bool:
        """Whether a recorded step is still to be taken again before new groups."""
        return bool(self._redo)

    def at_start(self, config: KafkaConfig, consumer: Consumer, deadline: Deadline
                 ) -> tuple[Standing, dict[int, int | None]]:
        """Where the group stands as its consumer starts, and its committed offsets (None: nothing committed).

        The position is the committed offsets, else each partition's start. With manifests, the ledger and the
        next step come from the group's manifests, and the steps handed over and never committed are taken
        again first, as recorded. Blocks until the offsets and the manifests are read, all reads together at most
        until `deadline`. Raises what the reads raise (RollstreamError; KafkaIOError ``_TIMED_OUT`` once
        `deadline` passed).
        """
        topic = self.names.rollouts
        partitions = partitions_of(consumer, topic, timeout=deadline)
        found = committed_with_metadata(consumer, topic, partitions, timeout=deadline)
        committed = {p: offset for p, (offset, _) in found.items()}
        position = {p: c if c is not None else watermarks(consumer, topic, p, timeout=deadline)[0]
                    for p, c in committed.items()}
        if not self._manifests:
            ledger = StepLedger(dedupe_epochs=self._dedupe_epochs, window=self._dedupe_window)
            return Standing(position, ledger, 0, (), None), committed
        read = self._read(config, ManifestIndex.newest(meta for _, meta in found.values()), deadline)
        # Pending manifests (past the committed offsets) must not move the dedupe window: it counts from committed.
        ledger = StepLedger(dedupe_epochs=self._dedupe_epochs, window=self._dedupe_window, committed=committed)
        for manifest in read.manifests:
            ledger.add(manifest)
        orphans = [o.step for o in ledger.drop_uncommitted(committed)]
        redo = tuple(chained(latest_by_step(read.manifests, orphans), position))
        if orphans:
            log.warning("group %s: steps %s were handed over but never committed (the trainer stopped before "
                        "committing them); taking steps %s again first, as recorded", self.group_id, orphans,
                        [m.step for m in redo])
        return Standing(position, ledger, ledger.next_step, redo, read.index), committed

    def after_step(self, config: KafkaConfig, step: int, current: Mapping[int, int],
                   index: ManifestIndex | None, deadline: Deadline) -> Standing:
        """Where the group stands right after its step `step` (`RolloutConsumer.seek_to_step`), from `current`.

        The position is where `step` ended on every partition (`position_after`), the ledger holds the effective
        steps up to it, and the steps after it are taken again first, as recorded. Blocks until the manifests
        are read (where `index` says; None: all of NS.steps), at most until `deadline`.

        Raises:
            RollstreamError: the consumer keeps no manifests, the group has no step `step` (the message names the
                steps it has), or a read failed.
        """
        if not self._manifests:
            raise RollstreamError(f"seek_to_step({step}) needs the step manifests: create the consumer of group "
                                  f"{self.group_id} with manifests=True")
        history = StepLedger(keep_manifests=True)
        read = self._read(config, index, deadline)
        for m in read.manifests:
            history.add(m)
        effective = sorted(history.effective(), key=lambda m: m.step)
        if not any(m.step == step for m in effective):
            known = f"steps {effective[0].step}..{effective[-1].step}" if effective else "no steps yet"
            raise RollstreamError(f"group {self.group_id} has no step {step} on {self.names.steps} ({known}); "
                                  "was the checkpoint saved by a trainer of another group or namespace?")
        upto = [m for m in effective if m.step <= step]
        later = [m for m in effective if m.step > step]
        position = position_after(upto, later, current)
        ledger = StepLedger(dedupe_epochs=self._dedupe_epochs, window=self._dedupe_window)
        for m in upto:
            ledger.add(m)
        return Standing(position, ledger, step + 1, tuple(chained(later, position)), read.index)

    def ledger_at(self, config: KafkaConfig, position: Mapping[int, int], committed: Mapping[int, int | None],
                  index: ManifestIndex | None, deadline: Deadline) -> StepLedger:
        """The ledger of the group's committed steps that end at or before `position` (`seek_to` back further than
        the dedupe window: its window counts from `position`, never from further on). Blocks until the manifests
        are read (where `index` says; None: all of NS.steps), at most until `deadline`; raises what the read raises
        (RollstreamError)."""
        limit = {p: min(c, position.get(p, c)) if c is not None else None for p, c in committed.items()}
        ledger = StepLedger(dedupe_epochs=self._dedupe_epochs, window=self._dedupe_window, committed=limit)
        for m in self._read(config, index, deadline).manifests:
            ledger.add(m)
        ledger.drop_uncommitted(committed)
        ledger.rewind(position)
        return ledger

    def redo(self, standing: Standing) -> None:
        """Take `standing`'s recorded steps again first, in place of any still queued."""
        self._redo = deque(standing.redo)

    def forget(self) -> None:
        """Take no recorded step again: the position moved (`seek_to`, uncommitted batches dropped)."""
        self._redo.clear()

    def take_again(self, config: KafkaConfig, n: int, position: Mapping[int, int],
                   deadline: Deadline) -> tuple[Batch, int] | None:
        """The next recorded step again, as the same batch continuing from `position`, and its groups' bytes.

        None, and no more recorded steps, when it took other than `n` groups or its records cannot be read
        back: the take then gathers afresh from `position`. Blocks until its records are read, at most until
        `deadline`; raises what the read raised (KafkaIOError) when `deadline` passed first, keeping the step to
        take again. The batch's offsets are the position after it; nothing is committed.
        """
        manifest = self._redo[0]
        taken = sum(1 for d in manifest.dispositions if d.kind == "taken")
        if taken != n:
            log.warning("group %s: step %d was recorded with %d groups but take(%d) asks for %d; taking afresh "
                        "from offsets %s instead of redoing steps %s", self.group_id, manifest.step, taken, n, n,
                        dict(position), [m.step for m in self._redo])
            self._redo.clear()
            return None
        try:
            records = read_taken(config, manifest, deadline=deadline)
        except RollstreamError as exc:
            if deadline.expired:
                raise  # out of time, not unreadable: the next take reads the same step again
            log.warning("group %s: cannot take recorded step %d again (%s); taking afresh from offsets %s",
                        self.group_id, manifest.step, exc, dict(position))
            self._redo.clear()
            return None
        self._redo.popleft()
        offsets = {**position, **{r.partition: r.end for r in manifest.ranges}}
        batch = Batch(step=manifest.step, groups=tuple(r.group for r in records if r.group is not None),
                      positions=tuple((r.partition, r.offset) for r in records), ranges=manifest.ranges,
                      dispositions=manifest.dispositions, offsets=offsets, consumer_group=self.group_id,
                      topic=self.names.rollouts, policy_version=manifest.policy_version,
                      created_at_ms=manifest.created_at_ms)
        return batch, sum(len(r.value) for r in records)

    def _read(self, config: KafkaConfig, index: ManifestIndex | None, deadline: Deadline) -> ManifestRead:
        """The group's manifests, read where `index` says they are (None: all of NS.steps). Blocks until read, at
        most until `deadline`."""
        started = time.monotonic()
        read = read_group_manifests(config, self.names.steps, self.group_id, index=index, deadline=deadline)
        log.info("group %s: read %d step manifests from %d records of %s in %.3f s (%s)", self.group_id,
                 len(read.manifests), read.records, self.names.steps, time.monotonic() - started,
                 "all of it: no index in the commits" if index is None else "where the commits' index says")
        return read
