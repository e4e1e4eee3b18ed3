"""Every offset a range of steps covered, with what each step did with it: what export and report read.

Built on replay (`_replay`): the same manifests that count (`effective_manifests`), the same offset-range
reads (`rollstream.infra.kafka_io.read_ranges`' `read_assigned`, under the trainer's own group id, never joined, never
committed) and
the same decoding (`record_of`). Where `replay_step` keeps a step's taken records, this keeps every offset
of the step's ranges (taken, filtered, duplicate, undecodable, requeued), so a filtered group can be looked
at as closely as a taken one.

Memory stays bounded for any number of steps: `steps_between` keeps where each chosen manifest lies on
NS.steps (a `StepSpan`, a few hundred bytes a step), not the manifests (~0.5 KB per offset they cover), and
reads them back a chunk of `MAX_RUN_OFFSETS` offsets at a time; adjacent steps are read from NS.rollouts in
one go (one fetch session per run of at most `MAX_RUN_OFFSETS` offsets, not one per step), each step is handed
on and let go as soon as its last record is read, and partitions that run ahead of the oldest unfinished step
are paused while too many records wait (`MAX_BUFFERED`); librdkafka fetches at most `READ_AHEAD_KIB` ahead,
in responses of at most `rollstream.infra.kafka_io.BOUNDED_FETCH_BYTES` (a consumer's defaults, 128 MiB ahead
in 4 MiB compressed responses, are what a slower reader would otherwise hold). Every function
blocks until its reads are done (no progress for `timeout` s is an error); an iterator must stay in the
thread that reads it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from confluent_kafka import Consumer, TopicPartition
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._manifests import located_manifests
from rollstream.consumers.forensics._replay import (
    READ_AHEAD_KIB,
    Progress,
    ReplayedRecord,
    effective_manifests,
    record_of,
    replay_range,
)
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.kafka_io import position_of, read_assigned, reader, watermarks
from rollstream.schemas import OffsetDisposition, RollstreamError, StepManifest

MAX_BUFFERED = 2000  # decoded records held waiting for their step, before partitions running ahead pause
GAP_RECORDS = 1000  # offsets between steps a read fetches and drops rather than start a new read
MAX_RUN_OFFSETS = 10_000  # offsets whose manifests are held at once (~5 MB): a run's, and a chunk read back


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


@dataclass(frozen=True)
class StepSpan:
    """The effective manifests of a range of steps, by where they lie on NS.steps (`steps_between`).

    Iterating reads them back from there in step order, `MAX_RUN_OFFSETS` offsets' worth at a time, so the
    span costs a few ints per step until read, however long the range. Re-iterable: each iteration reads
    NS.steps again (blocks while it reads; no progress for `timeout` s is an error). Not thread-safe.

    Attributes:
        heads: the manifests without their dispositions (step, ranges, time, versions), in step order.
        located: where each manifest is, (partition, offset) on `topic` (NS.steps).
        sizes: the offsets each manifest covers (what it weighs once read back).
    """

    config: KafkaConfig
    topic: str
    consumer_group: str
    heads: tuple[StepManifest, ...]
    located: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    timeout: float = 30.0

    def __len__(self) -> int:
        return len(self.heads)

    @property
    def steps(self) -> list[int]:
        return [m.step for m in self.heads]

    def __iter__(self) -> Iterator[StepManifest]:
        for chunk in _chunks(self.located, self.sizes, MAX_RUN_OFFSETS):
            wanted = set(chunk)
            found: dict[tuple[int, int], StepManifest] = {}  # read whole before it is handed on: no reader
            for partition in {p for p, _ in chunk}:  # stays open while the caller works
                offsets = [o for p, o in chunk if p == partition]
                bounds = {partition: (min(offsets), max(offsets) + 1)}
                found.update((at, m) for at, m in located_manifests(
                    self.config, self.topic, self.consumer_group, bounds=bounds, timeout=self.timeout,
                    read_ahead_kib=READ_AHEAD_KIB) if at in wanted)
            for at in chunk:
                if at not in found:
                    raise RollstreamError(f"{self.topic}[{at[0]}]@{at[1]}: the manifest of a step of "
                                          f"{self.consumer_group} is gone (deleted by retention?)")
                yield found[at]


def steps_between(config: KafkaConfig, namespace: str, consumer_group: str, first: int | None, last: int | None,
                  *, timeout: float = 30.0) -> StepSpan:
    """The group's effective manifests with ``first <= step <= last`` (None: open end), in step order, as a
    `StepSpan`: one read of NS.steps that keeps each manifest's place and ranges, not its dispositions.

    Raises:
        RollstreamError: the group has no step in that range (the message names the steps it has).
        KafkaIOError: NS.steps does not exist, or the broker did not answer in time.
    """
    topic = TopicNames(namespace).steps
    ledger = StepLedger(keep_manifests=True, remember_ids=False)
    where: dict[int, tuple[tuple[int, int], int]] = {}  # by id() of a light manifest the ledger holds
    for at, manifest in located_manifests(config, topic, consumer_group, timeout=timeout,
                                          read_ahead_kib=READ_AHEAD_KIB):
        light = replace(manifest, dispositions=())
        ledger.add(manifest, keep=light)
        where[id(light)] = (at, len(manifest.dispositions))
    effective = ledger.effective()
    chosen = sorted((m for m in effective if (first is None or m.step >= first) and (last is None or m.step <= last)),
                    key=lambda m: m.step)
    if not chosen:
        steps = sorted(m.step for m in effective)
        known = f"steps {steps[0]}..{steps[-1]}" if steps else "no committed steps"
        wanted = f"{'' if first is None else first}:{'' if last is None else last}"
        raise RollstreamError(f"group {consumer_group} in namespace {namespace} has no step in {wanted} ({known}); "
                              "check --steps, --group and --namespace")
    return StepSpan(config, topic, consumer_group, tuple(chosen),
                    tuple(where[id(m)][0] for m in chosen), tuple(where[id(m)][1] for m in chosen), timeout)


def read_steps(config: KafkaConfig, manifests: Iterable[StepManifest], *, max_buffered: int = MAX_BUFFERED,
               timeout: float = 30.0, progress: Progress | None = None) -> Iterator[CoveredStep]:
    """Each of `manifests` with every record its ranges cover, in the order given, each step as soon as its
    last record is read. Lazy, also in `manifests` (a `StepSpan` is read back as the steps are): one
    continuous read per run of adjacent steps (`_runs`).

    Raises:
        RollstreamError: an offset a step covered no longer exists (retention), or holds another group than
            its manifest says (the topic was recreated); KafkaIOError when a read fails.
    """
    pending = iter(manifests)
    head = next(pending, None)
    if head is None:
        return
    # One client under the steps' own group (never joined, never committed): a trainer granted only its
    # group may export. A fresh assignment per step would wait out a fetch in flight (up to fetch.wait.max.ms).
    with reader(config, head.consumer_group, read_ahead_kib=READ_AHEAD_KIB) as consumer:
        for run in _runs(chain([head], pending), GAP_RECORDS, MAX_RUN_OFFSETS):
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


def _runs(manifests: Iterable[StepManifest], gap: int, most: int) -> Iterator[list[StepManifest]]:
    """Consecutive manifests read in one go: a new run starts where the next step's ranges would add more
    than `gap` offsets no step of the run covers (steps far apart, a seek back), or would make the run cover
    more than `most` offsets (its manifests and wanted offsets are held until its last step is out)."""
    run: list[StepManifest] = []
    span: dict[int, tuple[int, int]] = {}
    covered = 0
    for m in manifests:
        wider, size = _span([m], span), _size(_span([m]))
        if run and (_size(wider) - (covered + size) > gap or covered + size > most):
            yield run
            run, wider, covered = [], _span([m]), 0
        run.append(m)
        span, covered = wider, covered + size
    if run:
        yield run


def _chunks(located: Sequence[tuple[int, int]], sizes: Sequence[int], most: int
            ) -> Iterator[list[tuple[int, int]]]:
    """`located` in order, cut where a chunk would weigh more than `most` offsets (at least one each)."""
    chunk: list[tuple[int, int]] = []
    weight = 0
    for at, size in zip(located, sizes, strict=True):
        if chunk and weight + size > most:
            yield chunk
            chunk, weight = [], 0
        chunk.append(at)
        weight += size
    if chunk:
        yield chunk


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
