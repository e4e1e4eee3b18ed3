"""Prove from the step manifests that every committed offset was accounted for exactly once.

For a consumer group, `audit` reads all its manifests on NS.steps and its committed offsets on
NS.rollouts, decides which manifests count with the same rules as the consumer
(`rollstream.consumers._ledger`: re-taken steps supersede their first manifest; manifests past the committed
offsets are pending, not counted), then checks, per partition of NS.rollouts:

- inside each manifest, every offset of its ranges has exactly one disposition;
- the counted manifests' ranges tile the partition from its first stored offset (or the first
  manifest, with ``from_first_manifest=True``) up to the committed offset: no gap, no overlap;
- no group id was taken twice.

Read-only: never commits, never joins the group. Blocks until everything is read; uses clients of its
own (safe to call from any thread).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._manifests import read_manifests
from rollstream.infra import KafkaConfig, LagReader, TopicNames
from rollstream.infra.kafka_io import REACH_TIMEOUT_S, require_topics
from rollstream.schemas import DISPOSITION_KINDS, SchemaError, StepManifest


@dataclass(frozen=True)
class AuditProblem:
    """One violation: `kind` is gap, overlap, outside (a disposition outside the ranges) or duplicate_group."""

    kind: str
    partition: int
    start: int
    end: int
    steps: tuple[int, ...]
    message: str


@dataclass(frozen=True)
class AuditReport:
    """What `audit` found. `ok` when there is no problem; `problems` sorted by partition and offset."""

    consumer_group: str
    topic: str
    steps: tuple[int, ...]
    committed: dict[int, int | None]
    counts: dict[str, int]
    problems: tuple[AuditProblem, ...]
    superseded: tuple[int, ...] = ()
    pending: tuple[int, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """A few lines for people: totals, then the first problem (if any)."""
        span = f"steps {self.steps[0]}..{self.steps[-1]}" if self.steps else "no steps"
        lines = [f"group {self.consumer_group} on {self.topic}: {len(self.steps)} committed step(s) ({span}); "
                 + ", ".join(f"{k} {v}" for k, v in self.counts.items()),
                 "committed offsets: " + ", ".join(f"[{p}] {o}" for p, o in sorted(self.committed.items()))]
        if self.superseded:
            lines.append(f"superseded manifests (re-taken after a crash or a seek): steps {list(self.superseded)}")
        if self.pending:
            lines.append(f"pending manifests (written, offsets not committed; will be re-taken): "
                         f"steps {list(self.pending)}")
        lines.extend(self.notes)
        if self.problems:
            lines.append(f"FAILED: {len(self.problems)} problem(s); first: {self.problems[0].message}")
        else:
            lines.append("OK: every committed offset is accounted for exactly once")
        return "\n".join(lines)


def audit(config: KafkaConfig, namespace: str, consumer_group: str, *, from_first_manifest: bool = False,
          timeout: float = 30.0) -> AuditReport:
    """Audit `consumer_group` in `namespace`. See the module docstring for what is checked.

    Raises:
        KafkaIOError: the topics do not exist or (retriable) the broker does not answer.
    """
    names = TopicNames(namespace)
    notes: list[str] = []
    require_topics(config, [names.rollouts, names.steps], namespace=namespace, timeout=min(timeout, REACH_TIMEOUT_S))

    def bad(offset: int, exc: SchemaError) -> None:
        notes.append(f"note: undecodable record under this group's key on {names.steps} offset {offset}: {exc}")

    manifests = read_manifests(config, names.steps, consumer_group, timeout=timeout, on_bad=bad)
    with LagReader(config) as reader:
        lag = reader.group_lag(consumer_group, names.rollouts, timeout=timeout)
    committed = {p.partition: p.committed for p in lag.partitions}
    ledger = StepLedger(keep_manifests=True)
    superseded = [s.step for m in manifests for s in ledger.add(m)]
    pending = [s.step for s in ledger.drop_uncommitted(committed)]
    effective = ledger.effective()
    problems: list[AuditProblem] = []
    counts: dict[str, int] = defaultdict(int)
    for m in effective:
        problems.extend(_check_manifest(m, counts))
    for part in lag.partitions:
        first = None if from_first_manifest else part.start
        problems.extend(_check_tiling(part.partition, effective, first, part.committed))
    problems.extend(_check_unique_groups(effective))
    problems.sort(key=lambda x: (x.partition, x.start, x.kind))
    return AuditReport(consumer_group, names.rollouts, tuple(m.step for m in effective), committed,
                       {k: counts.get(k, 0) for k in DISPOSITION_KINDS},
                       tuple(problems), tuple(superseded), tuple(pending), tuple(notes))


def _check_manifest(m: StepManifest, counts: dict[str, int]) -> list[AuditProblem]:
    """Every offset of each range has exactly one disposition, and none is outside the ranges."""
    by_partition: dict[int, list[int]] = defaultdict(list)
    for d in m.dispositions:
        by_partition[d.partition].append(d.offset)
        counts[d.kind] += 1
    problems = []
    ranges = {r.partition: r for r in m.ranges}
    for p, offsets in by_partition.items():
        r = ranges.get(p)
        seen: set[int] = set()
        for o in offsets:
            if r is None or not r.start <= o < r.end:
                problems.append(AuditProblem("outside", p, o, o + 1, (m.step,),
                                             f"partition {p} offset {o}: step {m.step} has a disposition outside "
                                             "its ranges"))
            elif o in seen:
                problems.append(AuditProblem("overlap", p, o, o + 1, (m.step,),
                                             f"partition {p} offset {o}: two dispositions in step {m.step}"))
            seen.add(o)
    for r in m.ranges:
        seen = set(by_partition.get(r.partition, ()))
        missing = [o for o in range(r.start, r.end) if o not in seen]
        if missing:
            problems.append(AuditProblem("gap", r.partition, missing[0], missing[0] + 1, (m.step,),
                                         f"partition {r.partition} offset {missing[0]}: no disposition in step "
                                         f"{m.step} ({len(missing)} offset(s) of [{r.start}, {r.end}) missing)"))
    return problems


def _check_tiling(partition: int, manifests: list[StepManifest], first: int | None,
                  committed: int | None) -> list[AuditProblem]:
    """The counted ranges of one partition cover [first, committed) back to back."""
    spans = sorted((r.start, r.end, m.step) for m in manifests for r in m.ranges if r.partition == partition)
    problems = []
    cursor, prev_step = (first if first is not None else spans[0][0] if spans else None), None
    for start, end, step in spans:
        if cursor is not None and start > cursor:
            after = f"after step {prev_step}" if prev_step is not None else "from the start of the topic"
            involved = tuple(s for s in (prev_step, step) if s is not None)
            problems.append(AuditProblem("gap", partition, cursor, start, involved,
                                         f"partition {partition} offsets [{cursor}, {start}): in no step ({after}, "
                                         f"before step {step})"))
        elif cursor is not None and start < cursor and prev_step is not None:
            problems.append(AuditProblem("overlap", partition, start, min(end, cursor), (prev_step, step),
                                         f"partition {partition} offsets [{start}, {min(end, cursor)}): in both step "
                                         f"{prev_step} and step {step}"))
        cursor, prev_step = max(end, cursor if cursor is not None else end), step
    if committed is not None and cursor is not None and committed > cursor:
        last = f"after step {prev_step}" if prev_step is not None else "with no step at all"
        problems.append(AuditProblem("gap", partition, cursor, committed, (prev_step,) if prev_step is not None else (),
                                     f"partition {partition} offsets [{cursor}, {committed}): committed but in no "
                                     f"step ({last})"))
    return problems


def _check_unique_groups(manifests: list[StepManifest]) -> list[AuditProblem]:
    first_seen: dict[str, tuple[int, int, int]] = {}
    problems = []
    for m in manifests:
        for d in m.dispositions:
            if d.kind != "taken" or d.group_id is None:
                continue
            if d.group_id in first_seen:
                p, o, step = first_seen[d.group_id]
                problems.append(AuditProblem("duplicate_group", d.partition, d.offset, d.offset + 1, (step, m.step),
                                             f"partition {d.partition} offset {d.offset}: group {d.group_id} taken "
                                             f"again in step {m.step} (first at [{p}]@{o} in step {step})"))
            else:
                first_seen[d.group_id] = (d.partition, d.offset, m.step)
    return problems
