"""Why a trainer waits: a read-only report of a namespace (`status`), and the diagnosis `TakeTimeout` carries.

`status` reads three parts, each in a thread of its own, all within one deadline:

- producers: the members of the producers' consumer group on NS.prompts (DescribeConsumerGroups: member,
  client and instance ids, host, assigned partitions) and the state each producer writes into the metadata
  of its prompt-offset commits (`rollstream.infra.ProducerState`: paused by backpressure or open, since when,
  when written);
- prompts: NS.prompts past the producers' committed offsets (no commit: from the log start), counted
  exactly from the offsets, and decoded by epoch up to `max_prompts` records (beyond that the epochs are
  "at least"); requeued prompts (attempt > 0) counted apart, undecodable records too;
- trainer: the trainer group's lag on NS.rollouts, its last step and that step's age, the dispositions of
  its last `recent_steps` effective steps by kind and reason label (from the newest records of NS.steps,
  with the consumer's own ledger rules), and a peek at the next `peek` groups past its committed offsets,
  judged as a take with the default filters would judge them.

Contract (pinned by tests/integration/test_status.py):

- Read-only: commits nothing and joins no group (explicit assignment; members come from the admin API).
- Bounded: `status` returns within about `timeout` s whatever the cluster does.
- Never raises for a part it could not read: `StatusReport.unavailable` names the part and why, and the
  diagnosis uses whatever was read.
- The diagnosis names the likely cause when a trainer would wait: NS.prompts empty, prompts exhausted,
  no producer, every producer paused by backpressure, every group looked at skipped by the filters.
  A cause is *blocking* when work is left that cannot reach the trainer without someone acting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from confluent_kafka import KafkaException, TopicPartition
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers.filters import FilterContext, GroupFilter, default_filters, reason_label
from rollstream.infra import (
    DEFAULT_TRAINER_GROUP,
    KafkaConfig,
    LagReader,
    ProducerState,
    TopicNames,
    kafka_error,
    open_admin,
    partitions_of,
    position_of,
    read_ranges,
    reader,
    watermarks,
)
from rollstream.schemas import (
    OffsetDisposition,
    Prompt,
    RollstreamError,
    SchemaError,
    ScoredGroup,
    StepManifest,
    decode,
    now_ms,
)

log = logging.getLogger(__name__)
PARTS: tuple[str, ...] = ("producers", "prompts", "trainer")
_KIND_ORDER = ("taken", "filtered", "requeued", "duplicate", "undecodable")
_REASON_KINDS = frozenset({"filtered", "requeued"})  # kinds whose reason label is worth counting
_MAX_WHY = 300


@dataclass(frozen=True)
class ProducerInfo:
    """One producer: a member of the producers' group now, or (`member_id` None) one that committed a state
    and is no longer a member.

    Attributes:
        producer_id: the member's ``group.instance.id`` (``--producer-id``), else the id in its committed state.
        member_id, client_id, host: as the group coordinator knows the member (None for a producer gone).
        partitions: NS.prompts partitions assigned to it (a producer gone: those its state is committed on).
        state: its newest committed `ProducerState` (None: it committed none yet).
    """

    producer_id: str | None
    member_id: str | None
    client_id: str | None
    host: str | None
    partitions: tuple[int, ...]
    state: ProducerState | None

    @property
    def paused(self) -> bool:
        return self.state is not None and self.state.paused


@dataclass(frozen=True)
class ProducersReport:
    """The producers' consumer group: its state (STABLE, EMPTY, DEAD, ...), members, producers gone."""

    group: str
    group_state: str
    members: tuple[ProducerInfo, ...]
    gone: tuple[ProducerInfo, ...]

    @property
    def paused(self) -> tuple[ProducerInfo, ...]:
        return tuple(m for m in self.members if m.paused)


@dataclass(frozen=True)
class EpochPrompts:
    """Prompts of one epoch left on NS.prompts; `requeued` of them were published again (attempt > 0)."""

    epoch: int
    left: int
    requeued: int


@dataclass(frozen=True)
class PromptsReport:
    """NS.prompts as the producers' group stands.

    Attributes:
        stored: records the topic holds now.
        left: records past the producers' committed offsets: not generated yet, or being generated (exact).
        epochs: the `left` records read, by epoch (all of them when `complete`, else a lower bound).
        read: how many of `left` were read; undecodable: how many of those were no Prompt.
        last_epoch: the newest epoch seen (of the records read, else of each partition's last record).
    """

    topic: str
    stored: int
    left: int
    epochs: tuple[EpochPrompts, ...]
    read: int
    undecodable: int
    last_epoch: int | None

    @property
    def complete(self) -> bool:
        return self.read >= self.left


@dataclass(frozen=True)
class WaitingGroups:
    """The next groups past the trainer group's committed offsets, judged as a take would judge them
    (default filters, dedupe against the steps read); `skipped` counts by reason label."""

    looked_at: int
    acceptable: int
    skipped: dict[str, int]
    max_staleness: int | None
    policy_version: int | None


@dataclass(frozen=True)
class TrainerReport:
    """The trainer group on NS.rollouts and NS.steps.

    Attributes:
        lag: committed lag on NS.rollouts (`rollstream.infra.LagReader`); committed: per partition (None: nothing).
        last_step, last_step_at_ms, policy_version: the newest effective step, when it was taken, at which
            policy version (None: no step found).
        recent_steps: the step numbers counted in `recent` (kind -> reason label -> offsets).
        pending_steps: steps whose manifest is written but whose offsets are not committed.
        steps_read_all: False when only the newest records of NS.steps were read.
        waiting: the peek at the next groups (None when the lag is 0 or the peek is off).
    """

    group: str
    topic: str
    lag: int
    committed: dict[int, int | None]
    last_step: int | None
    last_step_at_ms: int | None
    policy_version: int | None
    recent_steps: tuple[int, ...]
    recent: dict[str, dict[str, int]]
    pending_steps: tuple[int, ...]
    steps_read_all: bool
    waiting: WaitingGroups | None


@dataclass(frozen=True)
class Cause:
    """One finding. `code`: no_prompts | prompts_exhausted | no_producer | producers_paused | all_skipped |
    flowing. `blocking`: work is left that cannot reach a waiting trainer until someone acts."""

    code: str
    blocking: bool
    message: str


@dataclass(frozen=True)
class Diagnosis:
    """Likely causes of a wait, most telling first; `seen` is what a timed-out take itself looked at, `note`
    what limits the diagnosis (parts unreadable, an older read), `read_at_ms` when the cluster was read."""

    causes: tuple[Cause, ...] = ()
    seen: str | None = None
    note: str | None = None
    read_at_ms: int | None = None

    @property
    def blocked(self) -> bool:
        return any(c.blocking for c in self.causes)

    def why(self, most: int = 2) -> str:
        """The first `most` causes in one line (and the note)."""
        text = "; ".join(c.message for c in self.causes[:most]) or "no cause found"
        return f"{text} ({self.note})" if self.note else text

    def __str__(self) -> str:
        seen = f"This take {self.seen}.\n" if self.seen else ""
        return f"{seen}Why: {self.why()}"


@dataclass(frozen=True)
class StatusReport:
    """What `status` read, what it could not read (`unavailable`: part -> why) and its `diagnosis`."""

    namespace: str
    producer_group: str
    trainer_group: str
    read_at_ms: int
    producers: ProducersReport | None
    prompts: PromptsReport | None
    trainer: TrainerReport | None
    unavailable: dict[str, str]
    diagnosis: Diagnosis = field(default_factory=Diagnosis)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dicts and lists (`json.dumps` ready); computed flags added."""
        out = asdict(self)
        out["diagnosis"]["blocked"] = self.diagnosis.blocked
        if self.prompts is not None:
            out["prompts"]["complete"] = self.prompts.complete
        return out


def status(config: KafkaConfig, namespace: str, *, trainer_group: str = DEFAULT_TRAINER_GROUP,
           producer_group: str | None = None, recent_steps: int = 10, max_prompts: int = 200_000,
           peek: int = 100, max_staleness: int | None = None, policy_version: int | None = None,
           dynamic_sampling: bool = True, timeout: float = 10.0, parts: Iterable[str] = PARTS) -> StatusReport:
    """Read the status of `namespace` (see the module docstring). Thread-safe (clients of its own).

    Blocks up to about `timeout` s; a part not read by then is reported in ``unavailable`` (a reading thread
    that overruns ends on its own). Commits nothing. `policy_version` (default: the last step's) and
    `max_staleness` judge staleness in the peek; `parts` chooses among ``PARTS``.

    Raises:
        ConfigError: `namespace` is not a valid namespace. Nothing else: what cannot be read is reported.
    """
    names = TopicNames(namespace)
    pgroup = producer_group or names.producer_group
    budget = max(0.5, 0.8 * timeout)  # each read's own timeout: most end with their own error before the deadline
    deadline = time.monotonic() + budget
    filters = default_filters(dynamic_sampling=dynamic_sampling)
    jobs: dict[str, Callable[[], object]] = {
        "producers": lambda: _read_producers(config, names.prompts, pgroup, budget),
        "prompts": lambda: _read_prompts(config, names.prompts, pgroup, max_prompts, budget, deadline),
        "trainer": lambda: _read_trainer(config, names, trainer_group, _TrainerAsk(
            recent_steps, peek, filters, max_staleness, policy_version), budget, deadline),
    }
    wanted = [p for p in parts if p in jobs]
    results, unavailable = _run_within({p: jobs[p] for p in wanted}, timeout)
    producers = _typed(results.get("producers"), ProducersReport)
    prompts = _typed(results.get("prompts"), PromptsReport)
    trainer = _typed(results.get("trainer"), TrainerReport)
    diagnosis = Diagnosis(causes=causes_of(names, pgroup, producers, prompts, trainer),
                          note=_unavailable_note(unavailable), read_at_ms=now_ms())
    return StatusReport(namespace, pgroup, trainer_group, now_ms(), producers, prompts, trainer, unavailable,
                        diagnosis)


_T = TypeVar("_T")


def _typed(value: object, cls: type[_T]) -> _T | None:
    return value if isinstance(value, cls) else None


# -- reading --------------------------------------------------------------------------------------


def _run_within(jobs: Mapping[str, Callable[[], object]], timeout: float) -> tuple[dict[str, object], dict[str, str]]:
    """Run each job in a daemon thread; wait for all up to `timeout` s. (results, part -> why not)."""
    lock = threading.Lock()
    done: dict[str, object] = {}
    failed: dict[str, str] = {}

    def run(name: str, job: Callable[[], object]) -> None:
        try:
            value = job()
        except Exception as exc:  # noqa: BLE001 - reported, never raised: the contract
            with lock:
                failed[name] = _why(exc)
            return
        with lock:
            done[name] = value

    threads = [threading.Thread(target=run, args=(n, j), name=f"rollstream-status-{n}", daemon=True)
               for n, j in jobs.items()]
    deadline = time.monotonic() + timeout
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    with lock:
        results, errors = dict(done), dict(failed)
    for name in jobs:
        if name not in results and name not in errors:
            errors[name] = (f"no answer within {timeout:g} s; is the cluster reachable (rollstream broker status)?")
    return results, errors


def _why(exc: BaseException) -> str:
    if isinstance(exc, KafkaException):
        exc = kafka_error("Kafka", exc)
    if isinstance(exc, TimeoutError):
        return "no answer in time; is the cluster reachable (rollstream broker status)?"
    text = str(exc) if isinstance(exc, RollstreamError) else f"{type(exc).__name__}: {exc}"
    return text[:_MAX_WHY]


def _committed(config: KafkaConfig, topic: str, group: str, timeout: float) -> dict[int, tuple[int | None, str | None]]:
    """partition -> (committed offset or None, its metadata) of `group` on `topic`, through a consumer that
    never joins (the admin API's ListConsumerGroupOffsets is avoided, as `rollstream.infra.lag` explains)."""
    with reader(config, group) as consumer:
        parts = partitions_of(consumer, topic, timeout=timeout)
        try:
            tps = consumer.committed([TopicPartition(topic, p) for p in parts], timeout=timeout)
        except KafkaException as exc:
            raise kafka_error(f"cannot read the committed offsets of {group} on {topic}", exc, topic=topic) from exc
    out: dict[int, tuple[int | None, str | None]] = {}
    for tp in tps:
        if tp.error is not None:
            raise kafka_error(f"cannot read the committed offset of {group} on {topic}[{tp.partition}]", tp.error,
                              topic=topic, partition=tp.partition)
        out[tp.partition] = (tp.offset if tp.offset >= 0 else None, tp.metadata or None)
    return out


def _read_producers(config: KafkaConfig, topic: str, group: str, timeout: float) -> ProducersReport:
    admin = open_admin(config.admin())
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout=timeout + 1.0)
    except KafkaException as exc:
        raise kafka_error(f"cannot describe the producers' group {group}", exc) from exc
    states = {p: s for p, (_, meta) in _committed(config, topic, group, timeout).items()
              if (s := ProducerState.from_metadata(meta)) is not None}
    members = []
    for m in desc.members:
        parts = tuple(sorted(tp.partition for tp in (m.assignment.topic_partitions if m.assignment else [])
                             if tp.topic == topic))
        mine = [s for s in states.values() if m.group_instance_id and s.producer_id == m.group_instance_id]
        mine = mine or ([] if m.group_instance_id else [states[p] for p in parts if p in states])
        state = max(mine, key=lambda s: s.updated_at_ms, default=None)
        pid = m.group_instance_id or (state.producer_id if state else None)
        members.append(ProducerInfo(pid, m.member_id, m.client_id, m.host, parts, state))
    alive = {m.producer_id for m in members}
    gone: dict[str, ProducerInfo] = {}
    for p, s in sorted(states.items()):
        if s.producer_id in alive:
            continue
        known = gone.get(s.producer_id)
        if known is not None and known.state is not None and known.state.updated_at_ms >= s.updated_at_ms:
            s = known.state
        gone[s.producer_id] = ProducerInfo(s.producer_id, None, None, None, (*(known.partitions if known else ()), p),
                                           s)
    state_name = getattr(desc.state, "name", str(desc.state))
    return ProducersReport(group, state_name, tuple(members), tuple(gone.values()))


def _read_prompts(config: KafkaConfig, topic: str, group: str, max_records: int, timeout: float,
                  deadline: float) -> PromptsReport:
    committed = _committed(config, topic, group, timeout)
    with reader(config, group) as consumer:
        bounds = {p: watermarks(consumer, topic, p, timeout=timeout) for p in committed}
    starts = {p: max(low, committed[p][0] or 0) for p, (low, _) in bounds.items()}  # no commit: the log start
    stored = sum(high - low for low, high in bounds.values())
    left = sum(high - starts[p] for p, (_, high) in bounds.items())
    share = max(1, max_records // max(1, len(bounds)))
    scan = {p: (starts[p], min(high, starts[p] + share)) for p, (_, high) in bounds.items() if starts[p] < high}
    epochs: Counter[int] = Counter()
    requeued: Counter[int] = Counter()
    read = undecodable = 0
    for prompt in _prompts_in(config, topic, scan, group, timeout, deadline):
        read += 1
        if prompt is None:
            undecodable += 1
            continue
        epochs[prompt.epoch] += 1
        if getattr(prompt, "attempt", 0) > 0:
            requeued[prompt.epoch] += 1
    last_epoch = max(epochs, default=None)
    if left == 0 and stored > 0:  # exhausted: the epoch of each partition's last prompt names it
        tail = {p: (high - 1, high) for p, (low, high) in bounds.items() if high > low}
        last_epoch = max((pr.epoch for pr in _prompts_in(config, topic, tail, group, timeout, deadline)
                          if pr is not None), default=None)
    rows = tuple(EpochPrompts(e, epochs[e], requeued[e]) for e in sorted(epochs))
    return PromptsReport(topic, stored, left, rows, read, undecodable, last_epoch)


def _prompts_in(config: KafkaConfig, topic: str, bounds: Mapping[int, tuple[int, int]], group: str, timeout: float,
                deadline: float) -> Iterable[Prompt | None]:
    """Decoded prompts of `bounds` (None for an undecodable record), until done or `deadline`."""
    if not bounds:
        return
    # Leaving the loop early drops the reader generator, which closes its consumer (CPython frees it at once).
    for msg in read_ranges(config, topic, bounds, group_id=group, timeout=timeout):
        try:
            yield decode(msg.value() or b"", Prompt)
        except SchemaError:
            yield None
        if time.monotonic() > deadline:
            return


@dataclass(frozen=True)
class _TrainerAsk:
    recent_steps: int
    peek: int
    filters: Sequence[GroupFilter]
    max_staleness: int | None
    policy_version: int | None


def _read_trainer(config: KafkaConfig, names: TopicNames, group: str, ask: _TrainerAsk, timeout: float,
                  deadline: float) -> TrainerReport:
    with LagReader(config) as lag_reader:
        lag = lag_reader.group_lag(group, names.rollouts, timeout=timeout)
    committed = {p.partition: p.committed for p in lag.partitions}
    window = max(200, 20 * ask.recent_steps)
    manifests, read_all = _newest_manifests(config, names.steps, group, window, timeout)
    ledger = StepLedger(keep_manifests=True)
    for m in manifests:
        ledger.add(m)
    pending = tuple(sorted(s.step for s in ledger.drop_uncommitted(committed)))
    effective = sorted(ledger.effective(), key=lambda m: m.step)
    last = effective[-1] if effective else None
    recent = effective[-ask.recent_steps:] if ask.recent_steps > 0 else []
    version = ask.policy_version if ask.policy_version is not None else last.policy_version if last else None
    waiting = None
    if ask.peek > 0 and lag.total > 0:
        starts = {p.partition: (p.start if p.committed is None else max(p.committed, p.start), p.end)
                  for p in lag.partitions}
        waiting = _peek(config, names.rollouts, group, starts, ledger, ask, version, timeout, deadline)
    return TrainerReport(group, names.rollouts, lag.total, committed, last.step if last else None,
                         last.created_at_ms if last else None, last.policy_version if last else None,
                         tuple(m.step for m in recent), by_kind(d for m in recent for d in m.dispositions),
                         pending, read_all, waiting)


def _newest_manifests(config: KafkaConfig, topic: str, group: str, window: int, timeout: float
                      ) -> tuple[list[StepManifest], bool]:
    """`group`'s manifests among the newest `window` records of each partition of NS.steps, in log order."""
    key = group.encode()
    with reader(config, group) as consumer:  # the trainer's own group, as `rollstream.consumers._manifests` reads them
        bounds = {p: watermarks(consumer, topic, p, timeout=timeout) for p in partitions_of(consumer, topic,
                                                                                           timeout=timeout)}
    ranges = {p: (max(low, high - window), high) for p, (low, high) in bounds.items() if high > low}
    read_all = all(start == bounds[p][0] for p, (start, _) in ranges.items())
    out: list[StepManifest] = []
    for msg in read_ranges(config, topic, ranges, group_id=group, timeout=timeout):
        if msg.key() != key:
            continue
        try:
            manifest = decode(msg.value() or b"", StepManifest)
        except SchemaError as exc:
            log.debug("status: skipping an undecodable manifest of %s: %s", group, exc)
            continue
        if manifest.consumer_group == group:
            out.append(manifest)
    return out, read_all


def _peek(config: KafkaConfig, topic: str, group: str, bounds: Mapping[int, tuple[int, int]], ledger: StepLedger,
          ask: _TrainerAsk, version: int | None, timeout: float, deadline: float) -> WaitingGroups:
    share = max(1, ask.peek // max(1, len(bounds)))
    todo = {p: (s, min(e, s + share)) for p, (s, e) in bounds.items() if s < e}
    looked = acceptable = 0
    skipped: Counter[str] = Counter()
    for msg in read_ranges(config, topic, todo, group_id=group, timeout=timeout):
        partition, offset = position_of(msg)
        looked += 1
        label = _judge(msg.value() or b"", ledger, ask.filters,
                       FilterContext(version, ask.max_staleness, partition, offset, group))
        if label is None:
            acceptable += 1
        else:
            skipped[label] += 1
        if time.monotonic() > deadline:
            break
    return WaitingGroups(looked, acceptable, _ranked(skipped), ask.max_staleness, version)


def _judge(value: bytes, ledger: StepLedger, filters: Sequence[GroupFilter], context: FilterContext) -> str | None:
    """None when a take would take the group, else the label of why not (as `rollstream.consumers._gather` decides)."""
    try:
        group = decode(value, ScoredGroup)
    except SchemaError:
        return "undecodable"
    if ledger.is_taken(group.group_id):
        return "duplicate"
    for f in filters:
        try:
            reason = f(group, context)
        except Exception:  # noqa: BLE001 - a filter's bug is the take's to report (FilterError), not status's
            return "filter_error"
        if reason:
            return reason_label(str(reason))
    ledger.hold([group.group_id])  # a second copy further on would be a duplicate
    return None


def by_kind(dispositions: Iterable[OffsetDisposition]) -> dict[str, dict[str, int]]:
    """kind -> label -> count; the label is the reason's (`reason_label`) for filtered and requeued, else the kind."""
    counts: dict[str, Counter[str]] = {}
    for d in dispositions:
        label = reason_label(d.reason or "") if d.kind in _REASON_KINDS else d.kind
        counts.setdefault(d.kind, Counter())[label] += 1
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    return {k: _ranked(counts[k]) for k in sorted(counts, key=lambda k: (order.get(k, 99), k))}


# -- diagnosing -----------------------------------------------------------------------------------


def seen_line(dispositions: Sequence[OffsetDisposition]) -> str:
    """What a take looked at, e.g. ``looked at 40 groups: 40 filtered (stale 40)``."""
    if not dispositions:
        return "looked at no group (none arrived)"
    parts = []
    for kind, labels in by_kind(dispositions).items():
        total = sum(labels.values())
        detail = f" ({_labels(labels)})" if kind in _REASON_KINDS else ""
        parts.append(f"{total} {kind}{detail}")
    return f"looked at {len(dispositions)} group{'s' if len(dispositions) != 1 else ''}: " + ", ".join(parts)


def _ranked(counts: Mapping[str, int]) -> dict[str, int]:
    """Most first, ties by name: the same text for the same counts."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _labels(labels: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in _ranked(labels).items())


def skipped_cause(labels: Mapping[str, int], total: int, *, what: str, filtered_only: bool,
                  max_staleness: int | None, policy_version: int | None) -> Cause:
    """The all-skipped cause; `what` names the groups, ``{}`` where "filtered" or "skipped" goes."""
    word = "filtered" if filtered_only else "skipped"
    stale = (f" (max_staleness={max_staleness}, policy version {policy_version})"
             if "stale" in labels and max_staleness is not None else "")
    return Cause("all_skipped", True, f"{what.format(word)}: {_labels(labels)}{stale}")


def take_cause(dispositions: Sequence[OffsetDisposition], max_staleness: int | None,
               policy_version: int | None) -> Cause | None:
    """The all-skipped cause when a take looked at groups and took none of them."""
    if not dispositions or any(d.kind == "taken" for d in dispositions):
        return None
    labels: Counter[str] = Counter()
    for kind_labels in by_kind(dispositions).values():
        labels.update(kind_labels)
    n = len(dispositions)
    return skipped_cause(labels, n, what=f"the last {n} group{'s' if n != 1 else ''} looked at "
                         f"{'were all' if n != 1 else 'was'} {{}}", filtered_only=all(d.kind in _REASON_KINDS
                                                                                for d in dispositions),
                         max_staleness=max_staleness, policy_version=policy_version)


def causes_of(names: TopicNames, producer_group: str, producers: ProducersReport | None,
              prompts: PromptsReport | None, trainer: TrainerReport | None,
              first: Cause | None = None) -> tuple[Cause, ...]:
    """Every cause the parts show (None: not read), blocking ones first; `first` (a take's own) leads."""
    out: list[Cause] = [first] if first else []
    if first is None and trainer is not None and (cause := _waiting_cause(trainer)) is not None:
        out.append(cause)
    out += _prompt_causes(names.namespace, producer_group, prompts)
    out += _producer_causes(names.namespace, producer_group, producers, prompts.left if prompts else None)
    return tuple(sorted(out, key=lambda c: (c is not first, not c.blocking)))


def _waiting_cause(trainer: TrainerReport) -> Cause | None:
    waiting = trainer.waiting
    if waiting is None or not waiting.looked_at or waiting.acceptable:
        return None
    n = waiting.looked_at
    return skipped_cause(waiting.skipped, n, what=f"the next {n} groups waiting for {trainer.group} (past its "
                         "committed offsets) would all be {}",
                         filtered_only=not {"duplicate", "undecodable"} & set(waiting.skipped),
                         max_staleness=waiting.max_staleness, policy_version=waiting.policy_version)


def _prompt_causes(ns: str, producer_group: str, prompts: PromptsReport | None) -> list[Cause]:
    if prompts is None:
        return []
    if prompts.stored == 0:
        return [Cause("no_prompts", False, f"{prompts.topic} is empty: load prompts with "
                                           f"'rollstream prompts load FILE.jsonl --namespace {ns}'")]
    if prompts.left:
        return []
    epoch = prompts.last_epoch
    more = f" --start-epoch {epoch + 1}" if epoch is not None else ""
    return [Cause("prompts_exhausted", False, f"0 prompts left in epoch {epoch if epoch is not None else '?'} "
                  f"({prompts.topic} fully consumed by {producer_group}): load more with "
                  f"'rollstream prompts load FILE.jsonl --namespace {ns}{more}'")]


def _producer_causes(ns: str, producer_group: str, producers: ProducersReport | None, left: int | None
                     ) -> list[Cause]:
    if producers is None:
        return []
    members = producers.members
    if not members:
        work = left is None or left > 0
        hint = f": start one with 'rollstream produce --namespace {ns} ...'" if work else ""
        return [Cause("no_producer", work, f"0 producers in {producer_group}{hint}"
                      + (f" ({left} prompts left)" if left else ""))]
    states = [m.state for m in members if m.state is not None]
    if all(m.paused for m in members):
        return [Cause("producers_paused", True, f"all {len(members)} producers in {producer_group} paused by "
                      f"backpressure for {age(min(s.since_ms for s in states))} (max lag "
                      f"{max(s.max_lag for s in states)}): the trainer group they follow is behind; is it this "
                      "trainer's (produce --trainer-group), and does it commit?")]
    if left:
        alive = f"{len(members)} producer{'s' if len(members) != 1 else ''} alive"
        return [Cause("flowing", False, f"{alive}, {left} prompts left: groups come slower than asked; wait "
                      "longer or add producers")]
    return []


def _unavailable_note(unavailable: Mapping[str, str]) -> str | None:
    if not unavailable:
        return None
    return "; ".join(f"could not read {part}: {why}" for part, why in unavailable.items())


def age(at_ms: int) -> str:
    """How long ago `at_ms` was, for people: ``850 ms``, ``12 s``, ``3.5 min``, ``2.0 h``."""
    s = max(0, now_ms() - at_ms) / 1000
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 \
        else f"{s / 3600:.1f} h"


# -- TakeTimeout's diagnosis ----------------------------------------------------------------------


class TimeoutDiagnoser:
    """The diagnosis one consumer's `TakeTimeout`s carry. Thread-safe; never raises from `diagnose`.

    The take's own view (what it looked at) is computed at once, every time. The cluster view (producers
    and prompts, via `status`, bounded by `read_timeout_s`) is rate-limited: read in a background thread
    (``rollstream-status-*``) at most once every `refresh_s` per consumer, and reused in between (the
    diagnosis then says how old it is). `diagnose` waits for a read it started at most `wait_s`.
    """

    def __init__(self, config: KafkaConfig, names: TopicNames, *, producer_group: str | None = None,
                 refresh_s: float = 30.0, read_timeout_s: float = 5.0, max_prompts: int = 20_000) -> None:
        self._config, self._names = config, names
        self._producer_group = producer_group or names.producer_group
        self._refresh_s, self._read_timeout_s, self._max_prompts = refresh_s, read_timeout_s, max_prompts
        self._lock = threading.Lock()
        self._report: StatusReport | None = None
        self._read_at: float | None = None  # when the last read ended (monotonic), successful or not
        self._reading: threading.Event | None = None

    def diagnose(self, seen: Sequence[OffsetDisposition], *, wait_s: float, max_staleness: int | None = None,
                 policy_version: int | None = None) -> Diagnosis:
        """The diagnosis of a take that looked at `seen` and timed out. Blocks at most about `wait_s`."""
        try:
            line, first = seen_line(seen), take_cause(seen, max_staleness, policy_version)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never replace the timeout
            return Diagnosis(note=f"diagnosis unavailable: {type(exc).__name__}: {exc}")
        try:
            report = self._cluster_view(wait_s)
            if report is None:
                note = ("producers and prompts are being read (the next TakeTimeout carries them; or run "
                        f"'rollstream status --namespace {self._names.namespace}')")
                return Diagnosis(tuple(c for c in [first] if c), line, note)
            causes = causes_of(self._names, self._producer_group, report.producers, report.prompts, None, first)
            notes = [n for n in [_unavailable_note(report.unavailable)] if n]
            if now_ms() - report.read_at_ms > 1000:
                notes.append(f"producers and prompts as read {age(report.read_at_ms)} ago")
            return Diagnosis(causes, line, "; ".join(notes) or None, report.read_at_ms)
        except Exception as exc:  # noqa: BLE001
            return Diagnosis(tuple(c for c in [first] if c), line,
                             f"diagnosis unavailable: {type(exc).__name__}: {exc}"[:_MAX_WHY])

    def _cluster_view(self, wait_s: float) -> StatusReport | None:
        with self._lock:
            fresh = self._read_at is not None and time.monotonic() - self._read_at < self._refresh_s
            if not fresh and self._reading is None:
                self._reading = threading.Event()
                threading.Thread(target=self._read, args=(self._reading,), name="rollstream-status-timeout",
                                 daemon=True).start()
            reading = None if fresh else self._reading
        if reading is not None and wait_s > 0:
            reading.wait(wait_s)
        with self._lock:
            return self._report

    def _read(self, done: threading.Event) -> None:
        try:
            report: StatusReport | None = status(
                self._config, self._names.namespace, producer_group=self._producer_group,
                max_prompts=self._max_prompts, timeout=self._read_timeout_s, parts=("producers", "prompts"))
        except Exception as exc:  # noqa: BLE001 - `status` raises nothing it can read around; be sure
            log.debug("take timeout diagnosis failed: %s", exc)
            report = None
        with self._lock:
            if report is not None:
                self._report = report
            self._read_at = time.monotonic()  # a failed read also waits `refresh_s`: no storm of reads
            self._reading = None
        done.set()
