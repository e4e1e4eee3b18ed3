"""Deciding, record by record, what one take does with each offset it looks at.

Order of the checks (`judge`, the one place that decides whether a take would take a group, also for
`rollstream status`'s peek): undecodable, then duplicate (group id already taken, here or in an earlier
step), then the filters in order. The first that applies is the offset's disposition; otherwise
the group is taken. A filter's reason that may pass (stale, a retriable failure) requeues the prompt
while attempts remain (`rollstream.consumers._requeue`): the offset is ``requeued``, unless the same attempt was
requeued already (then it is a ``duplicate`` of that requeue).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from rollstream.consumers._batch import Batch
from rollstream.consumers._errors import FilterError
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._requeue import Requeue, requeue_of, terminal_reason
from rollstream.consumers.filters import FilterContext, GroupFilter, filter_name, older_run, stale
from rollstream.schemas import OffsetDisposition, PartitionRange, SchemaError, ScoredGroup, decode, now_ms

_MAX_REASON = 500


@dataclass(slots=True)
class Entry:
    """One fetched record, decoded at most once."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes
    decoded: ScoredGroup | SchemaError | None = None

    def group(self, topic: str) -> ScoredGroup | SchemaError:
        if self.decoded is None:
            try:
                self.decoded = decode(self.value, ScoredGroup)
            except SchemaError as exc:
                self.decoded = exc.located(topic, self.partition, self.offset)
        return self.decoded


def key_text(key: bytes | None) -> str | None:
    return None if key is None else key.decode("utf-8", "replace")


@dataclass(frozen=True)
class Skip:
    """Why a take would not take a group: `kind` undecodable, duplicate or filtered, and the `reason` (the
    decode error, "group_id already taken", or the first filter's reason as it returned it)."""

    kind: Literal["undecodable", "duplicate", "filtered"]
    reason: str


def judge(group: ScoredGroup | SchemaError, ledger: StepLedger, filters: Sequence[GroupFilter],
          context: FilterContext, *, dedupe: bool = True) -> Skip | None:
    """None when a take would take `group` (decoded, or the error decoding it), else why not. Reads the ledger
    and changes nothing: the caller holds a group it takes.

    Raises:
        FilterError: a filter raised (at `context`'s partition and offset).
    """
    if isinstance(group, SchemaError):
        return Skip("undecodable", str(group))
    if dedupe and ledger.is_taken(group.group_id):
        return Skip("duplicate", "group_id already taken")
    for f in filters:
        try:
            reason = f(group, context)
        except Exception as exc:
            raise FilterError(filter_name(f), context.partition, context.offset, exc) from exc
        if reason:
            return Skip("filtered", str(reason))
    return None


def stale_now(batch: Batch, filters: Sequence[GroupFilter], context: FilterContext) -> str | None:
    """Why a group the recorded `batch` took is stale in `context`, or None: what the staleness filters among
    `filters` say of it now, as a take would judge it. `older_run`: generated under an older trainer run than the
    consumer's, whatever ``max_staleness`` is; `stale`: that too, or a version now past ``max_staleness`` or
    ahead (only with ``max_staleness``). A recorded step with such a group is not taken again as recorded: its
    records are judged afresh."""
    rules = [f for f in (older_run, stale) if f in filters]
    for group, (p, o) in zip(batch.groups, batch.positions, strict=False):
        at = replace(context, partition=p, offset=o)
        for rule in rules:
            reason = rule(group, at)
            if reason is not None:
                return f"{group.group_id}: {reason}"
    return None


@dataclass
class Gathering:
    """The records one take has looked at so far, in order, and the decision for each.

    Taken ids are held in `ledger` as they are taken (dedupe within the step and against every earlier
    one asks the ledger alone); the consumer releases them when the step is committed or put back.
    """

    topic: str
    consumer_group: str
    filters: Sequence[GroupFilter]
    ledger: StepLedger
    dedupe: bool
    policy_version: int | None
    max_staleness: int | None
    requeue: bool = True
    policy_run: int | None = None
    entries: list[Entry] = field(default_factory=list)
    requeues: list[Requeue] = field(default_factory=list)
    dispositions: list[OffsetDisposition] = field(default_factory=list)
    groups: list[ScoredGroup] = field(default_factory=list)
    positions: list[tuple[int, int]] = field(default_factory=list)
    taken_bytes: int = 0

    @property
    def accepted(self) -> int:
        return len(self.groups)

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    def evaluate(self, entry: Entry) -> OffsetDisposition:
        """Decide what to do with `entry` (`judge`) and record it. Raises FilterError if a filter raises."""
        result = entry.group(self.topic)
        p, o = entry.partition, entry.offset
        context = FilterContext(self.policy_version, self.max_staleness, p, o, self.consumer_group, self.policy_run)
        skip = judge(result, self.ledger, self.filters, context, dedupe=self.dedupe)
        if isinstance(result, SchemaError):
            disp = OffsetDisposition(p, o, "undecodable", group_id=key_text(entry.key),
                                     reason=str(result)[:_MAX_REASON])
        elif skip is None:
            disp = OffsetDisposition(p, o, "taken", group_id=result.group_id, attempt=result.attempt)
            self.groups.append(result)
            self.positions.append((p, o))
            self.ledger.hold([result.group_id])
            self.taken_bytes += len(entry.value)
        elif skip.kind == "filtered":
            disp = self._skipped(result, p, o, skip.reason)
        else:
            disp = OffsetDisposition(p, o, skip.kind, group_id=result.group_id, reason=skip.reason[:_MAX_REASON])
        self.entries.append(entry)
        self.dispositions.append(disp)
        return disp

    def _skipped(self, group: ScoredGroup, partition: int, offset: int, reason: str) -> OffsetDisposition:
        """The disposition of a filtered group: requeued while its reason may pass and attempts remain."""
        again = requeue_of(group, reason, partition, offset) if self.requeue else None
        if again is None:
            return OffsetDisposition(partition, offset, "filtered", group_id=group.group_id,
                                     reason=terminal_reason(group, reason)[:_MAX_REASON], attempt=group.attempt)
        if self.ledger.requeued_from(partition, offset):  # published when an earlier take timed out
            return OffsetDisposition(partition, offset, "requeued", group_id=group.group_id,
                                     reason=reason[:_MAX_REASON], attempt=group.attempt)
        if self._requeued_as(group.group_id) >= again.attempt:
            return OffsetDisposition(partition, offset, "duplicate", group_id=group.group_id, attempt=group.attempt,
                                     reason=f"prompt already requeued as attempt {again.attempt}")
        self.requeues.append(again)
        return OffsetDisposition(partition, offset, "requeued", group_id=group.group_id, reason=reason[:_MAX_REASON],
                                 attempt=group.attempt)

    def _requeued_as(self, group_id: str) -> int:
        """The highest attempt `group_id`'s prompt was requeued as, by an earlier step or this one (0: never)."""
        mine = max((r.attempt for r in self.requeues if r.group_id == group_id), default=0)
        return max(mine, self.ledger.requeued_as(group_id))

    def ranges(self) -> tuple[PartitionRange, ...]:
        """Per partition looked at, [first offset, last offset + 1), in partition order."""
        bounds: dict[int, list[int]] = {}
        for e in self.entries:
            b = bounds.setdefault(e.partition, [e.offset, e.offset + 1])
            b[0], b[1] = min(b[0], e.offset), max(b[1], e.offset + 1)
        return tuple(PartitionRange(p, start, end) for p, (start, end) in sorted(bounds.items()))

    def batch(self, step: int, position: Mapping[int, int], requeues: Sequence[Requeue]) -> Batch:
        """The step these records make, numbered `step`: its offsets are `position` moved one past the last record
        looked at on each partition; `requeues` are those of its requeues still to publish with it."""
        offsets = dict(position)
        offsets.update({e.partition: e.offset + 1 for e in self.entries})
        return Batch(step=step, groups=tuple(self.groups), positions=tuple(self.positions), ranges=self.ranges(),
                     dispositions=tuple(self.dispositions), offsets=offsets, consumer_group=self.consumer_group,
                     topic=self.topic, policy_version=self.policy_version, created_at_ms=now_ms(),
                     requeues=tuple(requeues))
