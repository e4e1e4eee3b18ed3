"""Reading a consumer group's step manifests back from NS.steps (the consumer at start, replay, audit).

Built on the readers of `rollstream.infra.kafka_io`: explicit assignment, nothing committed, no group membership. The
reader's group id is the trainer's own group, so a principal granted only its own group reads manifests.

NS.steps is shared by every consumer group of the namespace, and a start needs all of its own group's manifests
(the ledger's taken ids and requeue attempts, `rollstream.consumers._ledger`) but none of the others'. So the
consumer keeps a `ManifestIndex` of where its group's manifests are and carries it in the metadata of its offset
commits (as producers carry their state, `rollstream.infra.producer_state`); a start reads only those ranges plus
what was written after the index was committed. Records of other groups inside the ranges are skipped without
decoding. A commit without an index (an older rollstream, another tool) means a read of everything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from rollstream.infra import KafkaConfig
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_io import partitions_of, position_of, read_ranges, reader, watermarks
from rollstream.schemas import SchemaError, StepManifest, decode

log = logging.getLogger(__name__)

_PREFIX = "rollstream-steps/1 "
MAX_EXTENTS = 8  # ranges per partition in an index: each costs one more fetch session at start
MERGE_GAP = 2000  # other groups' records between two ranges worth skipping by one more fetch session
_METADATA_LIMIT = 3000  # bytes; Kafka's offset.metadata.max.bytes is 4096 by default


@dataclass(frozen=True)
class PartIndex:
    """Where one group's manifests are on one partition of NS.steps.

    Attributes:
        upto: every manifest of the group at an offset below this lies in one of `extents`.
        extents: sorted, disjoint [start, end) offset ranges (they may hold other groups' records too).
    """

    upto: int
    extents: tuple[tuple[int, int], ...] = ()

    def added(self, offset: int) -> PartIndex:
        """This index with a manifest of the group at `offset`: after every offset added before it, and
        at or after `upto` unless the index is being built from a read of everything below `upto`."""
        spans = list(self.extents)
        if spans and offset - spans[-1][1] <= MERGE_GAP:
            spans[-1] = (spans[-1][0], offset + 1)
        else:
            spans.append((offset, offset + 1))
        while len(spans) > MAX_EXTENTS:  # merge across the smallest gap: fewest other records read
            i = min(range(len(spans) - 1), key=lambda j: spans[j + 1][0] - spans[j][1])
            spans[i:i + 2] = [(spans[i][0], spans[i + 1][1])]
        return PartIndex(max(self.upto, offset + 1), tuple(spans))

    def ranges(self, low: int, high: int) -> list[tuple[int, int]]:
        """The [start, end) ranges to read, within [low, high), to see every manifest of the group there."""
        spans = [*self.extents, (self.upto, high)]
        return [(s, e) for s, e in ((max(s, low), min(e, high)) for s, e in spans) if s < e]


@dataclass(frozen=True)
class ManifestIndex:
    """Where one group's manifests are on NS.steps, per partition; a partition not in `parts` is read whole."""

    parts: Mapping[int, PartIndex] = field(default_factory=dict)

    def added(self, partition: int, offset: int) -> ManifestIndex:
        """This index with a manifest of the group written at `offset` of `partition` (not before `upto`)."""
        part = self.parts.get(partition)
        if part is None:  # a partition the index never covered: it stays read whole
            return self
        return ManifestIndex({**self.parts, partition: part.added(offset)})

    def to_metadata(self) -> str | None:
        """The commit metadata string for this index (a version prefix and compact JSON); None when too long."""
        body = {str(p): [x.upto, [list(e) for e in x.extents]] for p, x in sorted(self.parts.items())}
        text = _PREFIX + json.dumps(body, separators=(",", ":"))
        return text if len(text) <= _METADATA_LIMIT else None

    @classmethod
    def from_metadata(cls, text: str | None) -> ManifestIndex | None:
        """The index in a commit's metadata, or None when it holds none (empty, another tool's, garbled)."""
        if not text or not text.startswith(_PREFIX):
            return None
        try:
            body = json.loads(text[len(_PREFIX):])
            return cls({int(p): PartIndex(int(upto), tuple((int(s), int(e)) for s, e in spans))
                        for p, (upto, spans) in body.items()})
        except (ValueError, TypeError, AttributeError):
            return None

    @classmethod
    def newest(cls, texts: Iterable[str | None]) -> ManifestIndex | None:
        """The most complete index in the metadata of a group's commits (per partition, the highest `upto`:
        every index the group committed stays true); None when none holds one."""
        parts: dict[int, PartIndex] = {}
        found = False
        for index in filter(None, map(cls.from_metadata, texts)):
            found = True
            for p, x in index.parts.items():
                if p not in parts or x.upto > parts[p].upto:
                    parts[p] = x
        return cls(parts) if found else None


@dataclass(frozen=True)
class ManifestRead:
    """What `read_group_manifests` found.

    Attributes:
        manifests: the group's manifests, in log order.
        index: where they are, complete up to the end of NS.steps when the read started.
        records: records fetched from NS.steps (the group's and others' inside the ranges read).
        decoded: records decoded (the group's own).
        whole: every partition was read from its log start (no index, no `newest` window cut anything).
    """

    manifests: list[StepManifest]
    index: ManifestIndex
    records: int
    decoded: int
    whole: bool = True


def read_manifests(config: KafkaConfig, steps_topic: str, consumer_group: str, *, timeout: float = 30.0,
                   on_bad: Callable[[int, SchemaError], None] | None = None) -> list[StepManifest]:
    """Every StepManifest of `consumer_group` on `steps_topic` (keyed by group), in log order: the whole
    topic is read. Blocks and raises as `read_group_manifests` does. Commits nothing."""
    return read_group_manifests(config, steps_topic, consumer_group, timeout=timeout, on_bad=on_bad).manifests


def read_group_manifests(config: KafkaConfig, steps_topic: str, consumer_group: str, *,
                         index: ManifestIndex | None = None, newest: int | None = None, timeout: float = 30.0,
                         on_bad: Callable[[int, SchemaError], None] | None = None,
                         deadline: Deadline | None = None) -> ManifestRead:
    """Every StepManifest of `consumer_group` on `steps_topic` (keyed by group), in log order, reading only
    where `index` says they can be (None: everything), and of each partition only its `newest` records
    (None: all; `rollstream status` reads a window, however long the history is).

    Records of other groups are skipped without decoding; an undecodable record under this group's
    key is reported to `on_bad(offset, error)` (default: a warning) and skipped. Blocks until everything
    present when it started is read (no progress for `timeout` s is an error), at most until `deadline` (None:
    none; each read then waits up to `timeout`). Commits nothing.

    Raises:
        KafkaIOError: NS.steps does not exist, or (retriable) the broker did not answer in time.
    """
    key = consumer_group.encode()
    # The trainer's own group: a principal granted it needs no other group ACL. Safe next to a live trainer:
    # this reader assigns (never joins) and never commits, so the group never sees it.
    group_id = consumer_group
    budget = Deadline.after(None) if deadline is None else deadline
    with reader(config, group_id) as consumer:
        partitions = partitions_of(consumer, steps_topic, timeout=budget.within(timeout))
        bounds = {p: watermarks(consumer, steps_topic, p, timeout=budget.within(timeout)) for p in partitions}
    starts = dict(bounds)
    if newest is not None:
        bounds = {p: (max(low, high - newest), high) for p, (low, high) in bounds.items()}
    plan = {p: _ranges(index, p, low, high) for p, (low, high) in bounds.items()}
    whole = index is None and all(bounds[p][0] == starts[p][0] for p in bounds)
    found = ManifestIndex({p: PartIndex(high) for p, (_, high) in bounds.items()})
    out: list[StepManifest] = []
    records = decoded = 0
    for round_ in range(max((len(r) for r in plan.values()), default=0)):  # one fetch session per range
        ranges = {p: r[round_] for p, r in plan.items() if round_ < len(r)}
        for msg in read_ranges(config, steps_topic, ranges, group_id=group_id, timeout=timeout, deadline=deadline):
            records += 1
            if msg.key() != key:
                continue
            partition, offset = position_of(msg)
            found = ManifestIndex({**found.parts, partition: found.parts[partition].added(offset)})
            decoded += 1
            manifest = _decoded(msg.value() or b"", steps_topic, partition, offset, on_bad)
            if manifest is not None and manifest.consumer_group == consumer_group:
                out.append(manifest)
    return ManifestRead(out, found, records, decoded, whole)


def located_manifests(config: KafkaConfig, steps_topic: str, consumer_group: str, *,
                      bounds: Mapping[int, tuple[int, int]] | None = None, timeout: float = 30.0,
                      read_ahead_kib: int | None = None) -> Iterator[tuple[tuple[int, int], StepManifest]]:
    """Each StepManifest of `consumer_group` on `steps_topic` with where it lies (partition, offset), in log
    order per partition, one at a time: within `bounds` ([start, end) per partition; None: all of the topic).
    Skips and reports undecodable records as `read_group_manifests` does. Lazy: blocks while it reads (no
    progress for `timeout` s is an error); must stay in the thread that reads it. Commits nothing.
    `read_ahead_kib`: as `rollstream.infra.kafka_io.reader`'s.

    Raises:
        KafkaIOError: NS.steps does not exist, or the broker did not answer in time.
    """
    key = consumer_group.encode()
    if bounds is None:
        with reader(config, consumer_group) as consumer:
            bounds = {p: watermarks(consumer, steps_topic, p, timeout=timeout)
                      for p in partitions_of(consumer, steps_topic, timeout=timeout)}
    for msg in read_ranges(config, steps_topic, bounds, group_id=consumer_group, timeout=timeout,
                           read_ahead_kib=read_ahead_kib):
        if msg.key() != key:
            continue
        partition, offset = position_of(msg)
        manifest = _decoded(msg.value() or b"", steps_topic, partition, offset, None)
        if manifest is not None and manifest.consumer_group == consumer_group:
            yield (partition, offset), manifest


def _ranges(index: ManifestIndex | None, partition: int, low: int, high: int) -> list[tuple[int, int]]:
    part = None if index is None else index.parts.get(partition)
    if part is None:
        return [(low, high)] if low < high else []
    return part.ranges(low, high)


def _decoded(value: bytes, topic: str, partition: int, offset: int,
             on_bad: Callable[[int, SchemaError], None] | None) -> StepManifest | None:
    try:
        return decode(value, StepManifest)
    except SchemaError as exc:
        exc.located(topic, partition, offset)
        if on_bad is None:
            log.warning("skipping an undecodable step manifest: %s", exc)
        else:
            on_bad(offset, exc)
        return None
