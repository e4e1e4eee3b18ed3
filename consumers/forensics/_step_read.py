"""Every offset a range of steps covered, with what each step did with it: what export and report read.

Built on replay (`_replay`): the same manifests that count (`effective_manifests`), the same offset-range
reads (`rollstream.infra.read_ranges`, under the trainer's own group id, never joined, never committed) and
the same decoding (`record_of`). Where `replay_step` keeps a step's taken records, this keeps every offset
of the step's ranges (taken, filtered, duplicate, undecodable, requeued), so a filtered group can be looked
at as closely as a taken one.

Memory stays bounded for any number of steps: consecutive steps are read together in chunks of about
`chunk_records` offsets (one fetch session per chunk, not per step), and a chunk's records are let go once
its steps are yielded. Every function blocks until its reads are done (no progress for `timeout` s is an
error); an iterator must stay in the thread that reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from rollstream.consumers.forensics._replay import (
    Progress,
    ReplayedRecord,
    effective_manifests,
    record_of,
    replay_range,
)
from rollstream.infra import KafkaConfig, position_of, read_ranges
from rollstream.schemas import OffsetDisposition, RollstreamError, StepManifest

CHUNK_RECORDS = 1000  # offsets read per fetch session: ~1,000 decoded groups held at once at most


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


def read_steps(config: KafkaConfig, manifests: Sequence[StepManifest], *, chunk_records: int = CHUNK_RECORDS,
               timeout: float = 30.0, progress: Progress | None = None) -> Iterator[CoveredStep]:
    """Each of `manifests` with every record its ranges cover, in the order given. Lazy: reads a chunk of
    consecutive steps (about `chunk_records` offsets) when the first of them is asked for.

    Raises:
        RollstreamError: an offset a step covered no longer exists (retention), or holds another group than
            its manifest says (the topic was recreated); KafkaIOError when a read fails.
    """
    for chunk in _chunks(manifests, chunk_records):
        bounds = _span(chunk)
        wanted = {(d.partition, d.offset) for m in chunk for d in m.dispositions}
        found: dict[tuple[int, int], ReplayedRecord] = {}
        for msg in read_ranges(config, chunk[0].topic, bounds, group_id=chunk[0].consumer_group, timeout=timeout,
                               progress=progress):
            if position_of(msg) in wanted:
                found[position_of(msg)] = record_of(msg)
        for m in chunk:
            yield CoveredStep(m, tuple(Covered(_checked(found, m, d), d, m) for d in m.dispositions))


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


def _chunks(manifests: Sequence[StepManifest], limit: int) -> Iterator[list[StepManifest]]:
    """Consecutive manifests whose joint span (what one read fetches) stays within `limit` offsets, at least
    one each: steps far apart (a seek back) are read apart, not across what lies between them."""
    chunk: list[StepManifest] = []
    for m in manifests:
        if chunk and _size(_span([*chunk, m])) > limit:
            yield chunk
            chunk = []
        chunk.append(m)
    if chunk:
        yield chunk


def _span(manifests: Sequence[StepManifest]) -> dict[int, tuple[int, int]]:
    bounds: dict[int, tuple[int, int]] = {}
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
