"""The three reads of `rollstream status`: producers, prompts, trainer. Each blocks up to about its `timeout`
(every read it makes has that timeout; its record scans stop at `deadline`) and raises what it cannot read
(`rollstream.consumers.forensics._status.status` reports that instead). Read-only: explicit assignment, no commits, no
membership (members come from the coordinator, asked by a child process).

- producers: the producers' group as the coordinator describes it, and each producer's state from the metadata
  of its prompt-offset commits (`rollstream.infra.producer_state.ProducerState`);
- prompts: the producers' group's lag on NS.prompts (`rollstream.infra.LagReader`), decoded by epoch up to
  `max_records` records;
- trainer: the trainer group's lag on NS.rollouts, its newest step manifests (with the consumer's own ledger
  rules), and a peek at the next groups judged as a take judges them (`rollstream.consumers._gather.judge`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollstream.consumers._errors import FilterError
from rollstream.consumers._gather import judge
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._manifests import read_group_manifests
from rollstream.consumers.filters import FilterContext, GroupFilter, reason_label
from rollstream.consumers.forensics._status_causes import by_kind, ranked
from rollstream.consumers.forensics._status_report import (
    EpochPrompts,
    ProducerInfo,
    ProducersReport,
    PromptsReport,
    TrainerReport,
    WaitingGroups,
)
from rollstream.infra import KafkaConfig, KafkaIOError, LagReader, TopicNames
from rollstream.infra.group_members import describe_group
from rollstream.infra.kafka_io import committed_with_metadata, partitions_of, position_of, read_ranges, reader
from rollstream.infra.producer_state import ProducerState
from rollstream.infra.runs import Followed, followed_policy
from rollstream.schemas import Prompt, SchemaError, ScoredGroup, StepManifest, decode

log = logging.getLogger(__name__)


def read_producers(config: KafkaConfig, topic: str, group: str, timeout: float) -> ProducersReport:
    """The producers' group on `topic`: members (the coordinator's description, read in a child process:
    `rollstream.infra.group_members`) and their committed states, producers gone."""
    desc = describe_group(config, group, timeout)
    states = _committed_states(config, topic, group, timeout)
    members = []
    for m in desc.members:
        parts = tuple(sorted(p for t, p in m.assignment if t == topic))
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
    return ProducersReport(group, desc.state, tuple(members), tuple(gone.values()))


def _committed_states(config: KafkaConfig, topic: str, group: str, timeout: float) -> dict[int, ProducerState]:
    """partition -> the `ProducerState` in the metadata of `group`'s commit on it (where there is one), read
    through a consumer that never joins (as `rollstream.infra.lag` explains); the caller bounds it from outside."""
    with reader(config, group) as consumer:
        found = committed_with_metadata(consumer, topic, partitions_of(consumer, topic, timeout=timeout),
                                        timeout=timeout)
    return {p: state for p, (_, metadata) in found.items()
            if (state := ProducerState.from_metadata(metadata)) is not None}


def read_prompts(config: KafkaConfig, topic: str, group: str, max_records: int, timeout: float,
                 deadline: float) -> PromptsReport:
    """NS.prompts past the producers' committed offsets: counted exactly (their lag), read by epoch up to
    `max_records` records or `deadline`."""
    with LagReader(config) as lags:  # a part's clients are its own: one that overruns closes them itself
        lag = lags.group_lag(group, topic, timeout=timeout)
    starts = {p.partition: p.end - p.lag for p in lag.partitions}  # no commit: the log start
    bounds = {p.partition: (p.start, p.end) for p in lag.partitions}
    stored = sum(high - low for low, high in bounds.values())
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
    if lag.total == 0 and stored > 0:  # exhausted: the epoch of each partition's last prompt names it
        tail = {p: (high - 1, high) for p, (low, high) in bounds.items() if high > low}
        last_epoch = max((pr.epoch for pr in _prompts_in(config, topic, tail, group, timeout, deadline)
                          if pr is not None), default=None)
    rows = tuple(EpochPrompts(e, epochs[e], requeued[e]) for e in sorted(epochs))
    return PromptsReport(topic, stored, lag.total, rows, read, undecodable, last_epoch)


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
class TrainerAsk:
    """What the trainer part is asked: steps to count, groups to peek at, and how to judge them."""

    recent_steps: int
    peek: int
    filters: Sequence[GroupFilter]
    max_staleness: int | None
    policy_version: int | None


def read_trainer(config: KafkaConfig, names: TopicNames, group: str, ask: TrainerAsk, timeout: float,
                 deadline: float) -> TrainerReport:
    """The trainer group: lag on NS.rollouts, its newest steps, and the peek (while lag is left)."""
    with LagReader(config) as lags:
        lag = lags.group_lag(group, names.rollouts, timeout=timeout)
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
        starts = {p.partition: (p.end - p.lag, p.end) for p in lag.partitions}
        waiting = _peek(config, names.rollouts, group, starts, ledger, ask, version, timeout, deadline)
    followed = _followed(config, names.control, timeout)
    policy = followed.policy if followed is not None else None
    return TrainerReport(group, names.rollouts, lag.total, committed, last.step if last else None,
                         last.created_at_ms if last else None, last.policy_version if last else None,
                         tuple(m.step for m in recent), by_kind(d for m in recent for d in m.dispositions),
                         pending, read_all, waiting, policy.version if policy else None,
                         policy.run if policy else None, policy.created_at_ms if policy else None,
                         followed.superseded if followed is not None else 0)


def _followed(config: KafkaConfig, topic: str, timeout: float) -> Followed | None:
    """What producers follow on NS.control (None, logged, when it cannot be read: the rest still reports)."""
    try:
        return followed_policy(config, topic, timeout=timeout)
    except KafkaIOError as exc:
        log.info("status: cannot read the policy versions on %s: %s", topic, exc)
        return None


def _newest_manifests(config: KafkaConfig, topic: str, group: str, window: int, timeout: float
                      ) -> tuple[list[StepManifest], bool]:
    """`group`'s manifests among the newest `window` records of each partition of NS.steps, in log order, and
    whether that was all of them: a status read stays bounded however long the history is
    (`TrainerReport.steps_read_all` says when it was all). Undecodable manifests are skipped."""
    read = read_group_manifests(config, topic, group, newest=window, timeout=timeout,
                                on_bad=lambda offset, exc: log.debug("status: skipping a manifest of %s: %s",
                                                                     group, exc))
    return read.manifests, read.whole


def _peek(config: KafkaConfig, topic: str, group: str, bounds: Mapping[int, tuple[int, int]], ledger: StepLedger,
          ask: TrainerAsk, version: int | None, timeout: float, deadline: float) -> WaitingGroups:
    share = max(1, ask.peek // max(1, len(bounds)))
    todo = {p: (s, min(e, s + share)) for p, (s, e) in bounds.items() if s < e}
    looked = acceptable = 0
    skipped: Counter[str] = Counter()
    for msg in read_ranges(config, topic, todo, group_id=group, timeout=timeout):
        partition, offset = position_of(msg)
        looked += 1
        label = _label(msg.value() or b"", ledger, ask.filters,
                       FilterContext(version, ask.max_staleness, partition, offset, group))
        if label is None:
            acceptable += 1
        else:
            skipped[label] += 1
        if time.monotonic() > deadline:
            break
    return WaitingGroups(looked, acceptable, ranked(skipped), ask.max_staleness, version)


def _label(value: bytes, ledger: StepLedger, filters: Sequence[GroupFilter], context: FilterContext) -> str | None:
    """None when a take would take the group (`judge`, the take's own decision), else the label of why not."""
    try:
        group: ScoredGroup | SchemaError = decode(value, ScoredGroup)
    except SchemaError as exc:
        group = exc
    try:
        skip = judge(group, ledger, filters, context)
    except FilterError:  # a filter's bug is the take's to raise, not status's
        return "filter_error"
    if skip is None:
        if isinstance(group, ScoredGroup):
            ledger.hold([group.group_id])  # a second copy further on would be a duplicate
        return None
    return reason_label(skip.reason) if skip.kind == "filtered" else skip.kind
