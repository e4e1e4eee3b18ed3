"""Every offset a range of steps covered, with what each step did with it: what export and report read.

Built on replay (`_replay`): the same manifests that count (`effective_manifests`), the same offset-range
reads (`rollstream.infra.kafka_io.read_ranges`' `read_assigned`, under the trainer's own group id, never joined, never
committed) and
the same decoding (`record_of`). Where `replay_step` keeps a step's taken records, this keeps every offset
of the step's ranges (taken, filtered, duplicate, undecodable, requeued), so a filtered group can be looked
at as closely as a taken one.

Memory stays bounded for any number of steps: adjacent steps are read in one go (one fetch session, not
one per step), each step is handed on and let go as soon as its last record is read, and partitions that
run ahead of the oldest unfinished step are paused while too many records wait (`MAX_BUFFERED`). Every
function blocks until its reads are done (no progress for `timeout` s is an error); an iterator must stay
in the thread that reads it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition
from rollstream.consumers.forensics._replay import (
    Progress,
    ReplayedRecord,
    effective_manifests,
    record_of,
    replay_range,
)
from rollstream.infra import KafkaConfig
from rollstream.infra.kafka_io import position_of, read_assigned, reader, watermarks
from rollstream.schemas import OffsetDisposition, RollstreamError, StepManifest

MAX_BUFFERED = 2000  # decoded records held waiting for their step, before partitions running ahead pause
GAP_RECORDS = 1000  # offsets between steps a read fetches and drops rather than start a new read


@dataclass(frozen=True)
class Covered:
    """One record of NS.rollouts and what the trainer group did with it.

    Attributes:
        record: the record as read back (its group, or its decode error).
        disposition: the step's disposition of its offset; None when no step of the group covered it
            (published, not looked at yet), only in offset-range reads.
        manifest: the step that covered it (its step number, trainer version, time), or None as above.
    """

    record: ReplayedRecord
    disposition: OffsetDisposition | None
    manifest: StepManifest | None


@dataclass(frozen=True)
class CoveredStep:
    """One step and every offset of its ranges, in the manifest's order (the order the take judged them)."""

    manifest: StepManifest
    records: tuple[Covered, ...]


def steps_between(config: KafkaConfig, namespace: str, consumer_group: str, first: int | None, last: int | None,
                  *, timeout: float = 30.0) -> list[StepManifest]:
    """The group's effective manifests with ``first <= step <= last`` (None: open end), in step order.

    Raises:
        RollstreamError: the group has no step in that range (the message names the steps it has).
    """
    effective = effective_manifests(config, namespace, consumer_group, timeout=timeout)
    chosen = sorted((m for m in effective if (first is None or m.step >= first) and (last is None or m.step <= last)),
                    key=lambda m: m.step)
    if not chosen:
        steps = sorted(m.step for m in effective)
        known = f"steps {steps[0]}..{steps[-1]}" if steps else "no committed steps"
        wanted = f"{'' if first is None else first}:{'' if last is None else last}"
        raise RollstreamError(f"group {consumer_group} in namespace {namespace} has no step in {wanted} ({known}); "
                              "check --steps, --group and --namespace")
    return chosen


def read_steps(config: KafkaConfig, manifests: Sequence[StepManifest], *, max_buffered: int = MAX_BUFFERED,
               timeout: float = 30.0, progress: Progress | None = None) -> Iterator[CoveredStep]:
    """Each of `manifests` with every record its ranges cover, in the order given, each step as soon as its
    last record is read. Lazy: one continuous read per run of adjacent steps (`_runs`).

    Raises:
        RollstreamError: an offset a step covered no longer exists (retention), or holds another group than
            its manifest says (the topic was recreated); KafkaIOError when a read fails.
    """
    if not manifests:
        return
    # One client under the steps' own group (never joined, never committed): a trainer granted only its
    # group may export. A fresh assignment per step would wait out a fetch in flight (up to fetch.wait.max.ms).
    with reader(config, manifests[0].consumer_group) as consumer:
        for run in _runs(manifests, GAP_RECORDS):
            yield from _assemble(consumer, run, max_buffered, timeout, progress)


def _assemble(consumer: Consumer, run: Sequence[StepManifest], max_buffered: int, timeout: float,
              progress: Progress | None) -> Iterator[CoveredStep]:
    """Read `run`'s span once; yield each step when every partition has reached its end. A partition that
    runs ahead of the first unfinished step while `max_buffered` records wait is paused until that step is
    out: the buffer holds about `max_buffered` records plus one fetch, however long the run."""
    topic, pending = run[0].topic, deque(run)
    wanted = {(d.partition, d.offset) for m in run for d in m.dispositions}
    found: dict[tuple[int, int], ReplayedRecord] = {}
    seen: dict[int, int] = {}
    paused: list[TopicPartition] = []
    span = _span(run)
    marks = {p: watermarks(consumer, topic, p, timeout=timeout) for p in span}
    for msg in read_assigned(consumer, topic, span, timeout=timeout, progress=progress):
        position = position_of(msg)
        seen[position[0]] = position[1]
        if position in wanted:
            found[position] = record_of(msg)
        while pending and _reached(pending[0], seen, marks):
            yield _covered(pending.popleft(), found)
            if paused:
                consumer.resume(paused)
                paused = []
        if pending and len(found) > max_buffered and not paused:
            # ahead: the first unfinished step needs nothing more from it (and the read is not done with it)
            paused = [TopicPartition(topic, p) for p, at in seen.items()
                      if _reached_on(pending[0], seen, marks, p) and at + 1 < min(span[p][1], marks[p][1])]
            if paused:
                consumer.pause(paused)
    while pending:  # what the read could not reach: `_checked` names the first missing offset
        yield _covered(pending.popleft(), found)


Marks = Mapping[int, tuple[int, int]]


def _reached(manifest: StepManifest, seen: Mapping[int, int], marks: Marks) -> bool:
    return all(_reached_on(manifest, seen, marks, r.partition) for r in manifest.ranges)


def _reached_on(manifest: StepManifest, seen: Mapping[int, int], marks: Marks, partition: int) -> bool:
    """Whether the read is past `manifest`'s range on `partition`, or will not reach it: the range lies past
    the partition's end or below its start (deleted). A record the step covered that is not there any more
    is then named by `_checked` at once, not waited for."""
    at, (low, high) = seen.get(partition, -1), marks.get(partition, (0, 2**63))
    return all(at >= min(r.end, high) - 1 or r.end <= low for r in manifest.ranges
               if r.partition == partition and r.end > r.start)


def _covered(manifest: StepManifest, found: dict[tuple[int, int], ReplayedRecord]) -> CoveredStep:
    """The step with its records, taken out of `found`."""
    step = CoveredStep(manifest, tuple(Covered(_checked(found, manifest, d), d, manifest)
                                       for d in manifest.dispositions))
    for d in manifest.dispositions:
        found.pop((d.partition, d.offset), None)
    return step


def read_range(config: KafkaConfig, namespace: str, consumer_group: str, bounds: Mapping[int, tuple[int, int]], *,
               timeout: float = 30.0, progress: Progress | None = None) -> Iterator[Covered]:
    """The records of NS.rollouts in `bounds` ([start, end) per partition, as `replay_range`), each with the
    step of `consumer_group` that covered it, if any. Holds the group's dispositions inside `bounds` in
    memory (one small entry per offset), never the records.

    Raises:
        RollstreamError, KafkaIOError: as `replay_range`, and when NS.steps cannot be read.
    """
    steps: dict[tuple[int, int], tuple[OffsetDisposition, StepManifest]] = {}
    for m in effective_manifests(config, namespace, consumer_group, timeout=timeout):
        for d in m.dispositions:
            low, high = bounds.get(d.partition, (0, -1))
            if low <= d.offset < high:
                steps[(d.partition, d.offset)] = (d, m)
    for record in replay_range(config, namespace, bounds, timeout=timeout, progress=progress):
        disposition, manifest = steps.get((record.partition, record.offset), (None, None))
        yield Covered(record, disposition, manifest)


def _runs(manifests: Sequence[StepManifest], gap: int) -> Iterator[list[StepManifest]]:
    """Consecutive manifests read in one go: a new run starts where the next step's ranges would add more
    than `gap` offsets no step of the run covers (steps far apart, a seek back), so a read never fetches
    much of what lies between. Runs grow with the steps; `_assemble` bounds the records held."""
    run: list[StepManifest] = []
    span: dict[int, tuple[int, int]] = {}
    covered = 0
    for m in manifests:
        wider = _span([m], span)
        if run and _size(wider) - (covered + _size(_span([m]))) > gap:
            yield run
            run, wider, covered = [], _span([m]), 0
        run.append(m)
        span, covered = wider, covered + _size(_span([m]))
    if run:
        yield run


def _span(manifests: Sequence[StepManifest], around: Mapping[int, tuple[int, int]] | None = None
          ) -> dict[int, tuple[int, int]]:
    """Per partition, [lowest start, highest end) of the manifests' ranges (and of `around`)."""
    bounds: dict[int, tuple[int, int]] = dict(around or {})
    for m in manifests:
        for r in m.ranges:
            low, high = bounds.get(r.partition, (r.start, r.end))
            bounds[r.partition] = (min(low, r.start), max(high, r.end))
    return bounds


def _size(bounds: Mapping[int, tuple[int, int]]) -> int:
    return sum(end - start for start, end in bounds.values())


def _checked(found: Mapping[tuple[int, int], ReplayedRecord], manifest: StepManifest,
             d: OffsetDisposition) -> ReplayedRecord:
    record = found.get((d.partition, d.offset))
    where = f"step {manifest.step}: {manifest.topic}[{d.partition}]@{d.offset}"
    if record is None:
        raise RollstreamError(f"{where} no longer exists (deleted by retention?); start at a later step")
    holds = record.group.group_id if record.group else None
    # an undecodable offset's disposition names the record's key, if any, not a decoded group
    expected = None if d.kind == "undecodable" else d.group_id
    if (d.kind == "undecodable" or d.group_id is not None) and holds != expected:
        raise RollstreamError(f"{where} holds {holds or 'an undecodable record'}, but the manifest says "
                              f"{expected or 'an undecodable record'} (was the topic recreated?)")
    return record
