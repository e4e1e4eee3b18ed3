"""Where a consumer group resumes, and which recorded steps it takes again exactly as they were.

Every step's manifest is on NS.steps before its batch is handed to the trainer (`RolloutConsumer.take`
writes it, then commits the offsets with ``commit=True`` or later in `commit`). So a step that was
handed over but never committed is still *recorded*: which offsets it looked at, in which order, and
which groups it took. A restarted consumer takes those recorded steps again first, each as the very
same batch (ids, order, step number), before it takes anything new; `seek_to_step` does the same for
the steps after a trainer checkpoint. Without this, which partition's records arrive first would
decide a rebuilt batch, and with several partitions it would almost never be the same.

A recorded step is taken again only while the steps chain: each starts, on every partition it
touches, at or after where the previous one ended. The first that does not (or whose records are gone)
ends the redo; from there on, groups are taken afresh (nothing is lost: the offsets were not committed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from rollstream.schemas import StepManifest

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
