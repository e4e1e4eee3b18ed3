"""Prove, for every loaded epoch, that each prompt was taken exactly once or ended with a terminal reason.

A *loaded* prompt is a decodable Prompt record on NS.prompts with ``attempt == 0``; its group id is
``make_group_id(prompt.id, prompt.epoch)``. Records with ``attempt > 0`` are requeues (the trainer published
the prompt again): not new prompts, but they can hold a prompt in flight. Which step manifests of the
trainer group count is decided by `rollstream.consumers._ledger.StepLedger`, the consumer's own rules.
Per loaded prompt:

- taken once in the effective manifests: ok. Taken two or more times: a problem (the steps are named).
- not taken, and a ``filtered`` disposition (terminal: data filters, or stale / failed after the last
  attempt): ok, terminal, counted by its reason label. ``requeued`` is not terminal, ``duplicate`` never counts.
- otherwise *in flight* when its group sits in a step not committed yet (pending), or on NS.rollouts at or
  past the trainer group's committed offset (published, not taken yet), or one of its prompt records is at
  or past the producers' committed offset on NS.prompts (not generated yet; no commit there: not generated).
- otherwise *lost*: a problem. A prompt id loaded twice in one epoch is a problem too.

The snapshot is read in the order in which work moves forward (the producers' committed offsets, the
trainer's committed offsets, the uncommitted tail of NS.rollouts, the manifests, NS.prompts last), so a run
that is still going can make a prompt look in flight that has just been taken, never lost.

Read-only: assign-based readers that never commit and never join a group. Blocks until everything is read
(each read fails after `timeout` s without progress); uses clients of its own (safe from any thread).
Undecodable records are counted, not fatal. NS.prompts is read whole, the rollouts only past the trainer's
committed offsets (bounded by the lag the producers' backpressure allows).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollstream.consumers._ledger import StepLedger, epoch_of
from rollstream.consumers._manifests import read_manifests
from rollstream.consumers.filters import reason_label
from rollstream.infra import KafkaConfig, LagReader, TopicNames
from rollstream.infra.kafka_io import REACH_TIMEOUT_S, position_of, read_ranges, require_topics
from rollstream.schemas import Prompt, SchemaError, ScoredGroup, StepManifest, decode, make_group_id

_OPEN_END = 2**62  # read_ranges clamps an end to what the partition holds when it starts reading
_SHOWN = 10  # in-flight prompts and problems listed in the summary (the JSON lists all)


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One decodable Prompt record on NS.prompts, where it sits."""

    partition: int
    offset: int
    prompt_id: str
    epoch: int
    attempt: int = 0

    @property
    def group_id(self) -> str:
        return make_group_id(self.prompt_id, self.epoch)

    @property
    def where(self) -> str:
        return f"prompts[{self.partition}]@{self.offset}"


@dataclass(frozen=True)
class EpochSnapshot:
    """What the epoch audit judges, as read from the topics (`read_snapshot`), or built by hand in tests.

    Attributes:
        prompts: every decodable Prompt record, in log order per partition.
        producer_committed: the producers' committed offset per NS.prompts partition (None: none).
        manifests: every StepManifest of the trainer group, in log order.
        trainer_committed: the trainer group's committed offset per NS.rollouts partition (None: none).
        unconsumed: group id -> (partition, offset) of its first record at or past `trainer_committed`.
        prompts_start: first stored offset per NS.prompts partition (above 0: retention deleted some).
    """

    namespace: str
    consumer_group: str
    producer_group: str
    prompts: Sequence[PromptRecord]
    producer_committed: Mapping[int, int | None]
    manifests: Sequence[StepManifest]
    trainer_committed: Mapping[int, int | None]
    unconsumed: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    prompts_start: Mapping[int, int] = field(default_factory=dict)
    undecodable_prompts: int = 0
    undecodable_groups: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class InFlightPrompt:
    """A loaded prompt neither taken nor terminal yet, and `why` it is still on its way (not a failure)."""

    prompt_id: str
    epoch: int
    group_id: str
    why: str


@dataclass(frozen=True)
class EpochProblem:
    """A prompt that is neither: `kind` is lost, taken_twice or loaded_twice; `steps` where it was taken."""

    kind: str
    prompt_id: str
    epoch: int
    steps: tuple[int, ...]
    message: str


@dataclass(frozen=True)
class EpochCounts:
    """One epoch's totals. `terminal` is by reason label; `requeued` counts requeued dispositions in effective
    steps, `requeue_prompts` the Prompt records with attempt > 0 on NS.prompts."""

    epoch: int
    loaded: int = 0
    taken: int = 0
    terminal: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    requeued: int = 0
    requeue_prompts: int = 0
    problems: int = 0

    def line(self) -> str:
        terminal = sum(self.terminal.values())
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.terminal.items()))
        return (f"epoch {self.epoch}: loaded {self.loaded}, taken {self.taken}, terminal {terminal}"
                + (f" ({reasons})" if reasons else "") + f", in flight {self.in_flight}, requeued {self.requeued}"
                + (f" ({self.requeue_prompts} prompt record(s) republished)" if self.requeue_prompts else "")
                + f", problems {self.problems}")


@dataclass(frozen=True)
class EpochAuditReport:
    """What the epoch audit found. `ok` when no prompt is lost, taken twice or loaded twice (in flight is ok)."""

    namespace: str
    consumer_group: str
    producer_group: str
    epochs: tuple[EpochCounts, ...]
    in_flight: tuple[InFlightPrompt, ...]
    problems: tuple[EpochProblem, ...]
    undecodable_prompts: int = 0
    undecodable_groups: int = 0
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self, *, shown: int = _SHOWN) -> str:
        """A few lines for people: OK or the first problem's prompt, per-epoch totals, in flight apart, notes."""
        if self.problems:
            lines = [f"FAILED: {self.problems[0].message} ({len(self.problems)} problem(s))"]
        else:
            flying = f"; {len(self.in_flight)} still in flight" if self.in_flight else ""
            lines = [f"OK: every prompt of {len(self.epochs)} epoch(s) taken exactly once or terminal{flying}"]
        lines.append(f"epoch audit of {self.namespace}: trainer group {self.consumer_group}, producers "
                     f"{self.producer_group}")
        lines.extend(e.line() for e in self.epochs)
        if not self.epochs:
            lines.append(f"no prompt loaded on {self.namespace}.prompts")
        lines.extend(_listed("in flight, not a failure", [f"{p.group_id}: {p.why}" for p in self.in_flight], shown))
        lines.extend(_listed("problems", [p.message for p in self.problems], shown))
        if self.undecodable_prompts or self.undecodable_groups:
            lines.append(f"undecodable: {self.undecodable_prompts} record(s) on {self.namespace}.prompts, "
                         f"{self.undecodable_groups} past the trainer's offsets on {self.namespace}.rollouts")
        lines.extend(self.notes)
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """Everything, as JSON-ready values (every in-flight prompt and problem, not only the first few)."""
        return {"ok": self.ok, **dataclasses.asdict(self)}


def _listed(title: str, items: Sequence[str], shown: int) -> list[str]:
    if not items:
        return []
    more = [f"  ... and {len(items) - shown} more (--json lists all)"] if len(items) > shown else []
    return [f"{title} ({len(items)}):"] + [f"  {item}" for item in items[:shown]] + more


def audit_epochs(config: KafkaConfig, namespace: str, consumer_group: str, *, producer_group: str | None = None,
                 timeout: float = 30.0) -> EpochAuditReport:
    """Audit every loaded epoch of `namespace` for the trainer group `consumer_group` (module docstring).

    `producer_group` is the producers' consumer group on NS.prompts (default ``NS.producers``). Blocks
    until everything is read; commits nothing and joins no group.

    Raises:
        KafkaIOError: a topic does not exist, or (retriable) the broker does not answer within `timeout`.
    """
    return judge(read_snapshot(config, namespace, consumer_group, producer_group=producer_group, timeout=timeout))


def read_snapshot(config: KafkaConfig, namespace: str, consumer_group: str, *, producer_group: str | None = None,
                  timeout: float = 30.0) -> EpochSnapshot:
    """Read what `judge` needs, in the order the module docstring gives. Blocks; commits nothing.

    Raises:
        KafkaIOError: a topic does not exist, or (retriable) the broker does not answer within `timeout`.
    """
    names = TopicNames(namespace)
    producers = producer_group or names.producer_group
    require_topics(config, [names.prompts, names.rollouts, names.steps], namespace=namespace,
                   timeout=min(timeout, REACH_TIMEOUT_S))
    with LagReader(config) as lag:
        intake = lag.group_lag(producers, names.prompts, timeout=timeout)
        trainer = lag.group_lag(consumer_group, names.rollouts, timeout=timeout)
    tail = {p.partition: (p.committed if p.committed is not None else p.start, p.end) for p in trainer.partitions}
    unconsumed, bad_groups = _read_unconsumed(config, names.rollouts, tail, consumer_group, timeout)
    notes: list[str] = []

    def bad_manifest(offset: int, exc: SchemaError) -> None:
        notes.append(f"note: undecodable record under this group's key on {names.steps} offset {offset}: {exc}")

    manifests = read_manifests(config, names.steps, consumer_group, timeout=timeout, on_bad=bad_manifest)
    starts = {p.partition: p.start for p in intake.partitions}
    prompts, bad_prompts = _read_prompts(config, names.prompts, starts, producers, timeout)
    return EpochSnapshot(namespace, consumer_group, producers, prompts,
                         {p.partition: p.committed for p in intake.partitions}, manifests,
                         {p.partition: p.committed for p in trainer.partitions}, unconsumed, starts,
                         bad_prompts, bad_groups, tuple(notes))


def _read_unconsumed(config: KafkaConfig, topic: str, bounds: Mapping[int, tuple[int, int]], group: str,
                     timeout: float) -> tuple[dict[str, tuple[int, int]], int]:
    """Group id -> first (partition, offset) of each group in `bounds`; and how many records were undecodable."""
    found: dict[str, tuple[int, int]] = {}
    bad = 0
    for msg in read_ranges(config, topic, bounds, group_id=group, timeout=timeout):
        position = position_of(msg)
        try:
            group_id = decode(msg.value() or b"", ScoredGroup).group_id
        except SchemaError:
            bad += 1
            continue
        found.setdefault(group_id, position)
    return found, bad


def _read_prompts(config: KafkaConfig, topic: str, starts: Mapping[int, int], group: str,
                  timeout: float) -> tuple[list[PromptRecord], int]:
    """Every decodable Prompt record of `topic` from `starts` to the end; and how many were undecodable."""
    records: list[PromptRecord] = []
    bad = 0
    for msg in read_ranges(config, topic, {p: (s, _OPEN_END) for p, s in starts.items()}, group_id=group,
                           timeout=timeout):
        partition, offset = position_of(msg)
        try:
            prompt = decode(msg.value() or b"", Prompt)
        except SchemaError:
            bad += 1
            continue
        records.append(PromptRecord(partition, offset, prompt.id, prompt.epoch, prompt.attempt))
    return records, bad


@dataclass
class _Outcomes:
    """What the effective and pending manifests say about each group id."""

    taken: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    terminal: dict[str, str] = field(default_factory=dict)
    requeued: Counter[int] = field(default_factory=Counter)
    pending: dict[str, int] = field(default_factory=dict)
    undecodable: int = 0


@dataclass
class _Tally:
    loaded: int = 0
    taken: int = 0
    terminal: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    problems: int = 0


def _outcomes(snapshot: EpochSnapshot) -> _Outcomes:
    ledger = StepLedger(keep_manifests=True)
    for m in snapshot.manifests:
        ledger.add(m)
    pending = ledger.drop_uncommitted(snapshot.trainer_committed)
    out = _Outcomes()
    for m in ledger.effective():
        for d in m.dispositions:
            if d.kind == "undecodable" or d.group_id is None:
                out.undecodable += d.kind == "undecodable"
            elif d.kind == "taken":
                out.taken[d.group_id].append(m.step)
            elif d.kind == "filtered":
                out.terminal[d.group_id] = d.reason or "unnamed"  # the last one: a later attempt's word wins
            elif d.kind == "requeued" and (epoch := epoch_of(d.group_id)) is not None:
                out.requeued[epoch] += 1
    for s in pending:
        for d in s.manifest.dispositions if s.manifest is not None else ():
            if d.group_id is not None:
                out.pending.setdefault(d.group_id, s.step)
    return out


def judge(snapshot: EpochSnapshot) -> EpochAuditReport:
    """Classify every loaded prompt of `snapshot` (module docstring). Pure: no I/O."""
    outcomes = _outcomes(snapshot)
    loaded: dict[str, list[PromptRecord]] = defaultdict(list)
    latest: dict[str, PromptRecord] = {}
    ungenerated: dict[str, PromptRecord] = {}
    republished: Counter[int] = Counter()
    for r in snapshot.prompts:
        gid = r.group_id
        if r.attempt == 0:
            loaded[gid].append(r)
        else:
            republished[r.epoch] += 1
        if gid not in latest or r.attempt >= latest[gid].attempt:
            latest[gid] = r
        committed = snapshot.producer_committed.get(r.partition)
        if (committed is None or r.offset >= committed) and gid not in ungenerated:
            ungenerated[gid] = r
    tallies: dict[int, _Tally] = defaultdict(_Tally)
    in_flight: list[InFlightPrompt] = []
    problems: list[EpochProblem] = []
    for gid, records in loaded.items():
        first = records[0]
        tally = tallies[first.epoch]
        tally.loaded += 1
        if len(records) > 1:
            problems.append(EpochProblem("loaded_twice", first.prompt_id, first.epoch, (), _name(first)
                                         + f": loaded {len(records)} times (" + ", ".join(r.where for r in records)
                                         + ")"))
        verdict = _verdict(gid, first, latest[gid], outcomes, snapshot, ungenerated)
        if isinstance(verdict, EpochProblem):
            problems.append(verdict)
        elif isinstance(verdict, InFlightPrompt):
            in_flight.append(verdict)
            tally.in_flight += 1
        elif verdict[0] == "taken":
            tally.taken += 1
        else:
            tally.terminal[reason_label(verdict[1])] += 1
    for p in problems:
        tallies[p.epoch].problems += 1
    problems.sort(key=lambda p: (p.epoch, p.prompt_id, p.kind))
    in_flight.sort(key=lambda p: (p.epoch, p.prompt_id))
    epochs = tuple(EpochCounts(e, t.loaded, t.taken, dict(t.terminal), t.in_flight, outcomes.requeued[e],
                               republished[e], t.problems) for e, t in sorted(tallies.items()))
    return EpochAuditReport(snapshot.namespace, snapshot.consumer_group, snapshot.producer_group, epochs,
                            tuple(in_flight), tuple(problems), snapshot.undecodable_prompts,
                            snapshot.undecodable_groups, snapshot.notes + _notes(snapshot, loaded, outcomes))


def _name(r: PromptRecord) -> str:
    return f"prompt {r.prompt_id} epoch {r.epoch}"


def _verdict(gid: str, first: PromptRecord, last: PromptRecord, outcomes: _Outcomes, snapshot: EpochSnapshot,
             ungenerated: Mapping[str, PromptRecord]) -> tuple[str, str] | InFlightPrompt | EpochProblem:
    """("taken", ""), ("terminal", reason), in flight (and why), or a problem, for one loaded prompt."""
    steps = outcomes.taken.get(gid, [])
    if len(steps) >= 2:
        return EpochProblem("taken_twice", first.prompt_id, first.epoch, tuple(steps),
                            f"{_name(first)}: taken {len(steps)} times (steps {', '.join(map(str, steps))})")
    if steps:
        return "taken", ""
    if gid in outcomes.terminal:
        return "terminal", outcomes.terminal[gid]
    why = _why_in_flight(gid, outcomes, snapshot, ungenerated)
    if why is not None:
        return InFlightPrompt(first.prompt_id, first.epoch, gid, why)
    attempt = f", attempt {last.attempt}," if last.attempt else ""
    return EpochProblem("lost", first.prompt_id, first.epoch, (),
                        f"{_name(first)}: no group taken, none terminal, nothing in flight (its prompt record at "
                        f"{last.where}{attempt} is committed by the producers)")


def _why_in_flight(gid: str, outcomes: _Outcomes, snapshot: EpochSnapshot,
                   ungenerated: Mapping[str, PromptRecord]) -> str | None:
    """Why the prompt of `gid` is still on its way, furthest along first; None when it is not."""
    if gid in outcomes.pending:
        return f"in step {outcomes.pending[gid]}, written but not committed yet (will be taken again)"
    if gid in snapshot.unconsumed:
        p, o = snapshot.unconsumed[gid]
        return f"published at rollouts[{p}]@{o}, not taken yet"
    if gid in ungenerated:
        r = ungenerated[gid]
        attempt = f" (attempt {r.attempt})" if r.attempt else ""
        return f"not generated yet: {r.where}{attempt} is not committed by {snapshot.producer_group}"
    return None


def _notes(snapshot: EpochSnapshot, loaded: Mapping[str, list[PromptRecord]], outcomes: _Outcomes) -> tuple[str, ...]:
    notes = []
    deleted = {p: s for p, s in sorted(snapshot.prompts_start.items()) if s > 0}
    if deleted:
        notes.append("note: retention deleted the start of " + ", ".join(f"prompts[{p}] (below {s})"
                                                                      for p, s in deleted.items())
                     + ": prompts loaded there are not audited")
    strangers = sorted(g for g in outcomes.taken if g not in loaded)
    if strangers:
        notes.append(f"note: {len(strangers)} taken group(s) answer no prompt loaded on {snapshot.namespace}.prompts "
                     f"(e.g. {strangers[0]}): deleted by retention, or published without a prompt")
    if outcomes.undecodable:
        notes.append(f"note: {outcomes.undecodable} undecodable record(s) accounted in effective steps (no prompt)")
    return tuple(notes)
