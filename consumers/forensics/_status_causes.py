"""Why a trainer waits, in words: the causes a status report or a timed-out take shows, and how they are said.

Pure functions of what was read (`_status_report`); no I/O. A cause is *blocking* when work
is left that cannot reach the trainer without someone acting: NS.prompts empty and prompts exhausted are idle
(nothing to unblock); no producer while prompts are left, every producer paused by backpressure, and every group
looked at skipped are blocking.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from rollstream.consumers.filters import reason_label
from rollstream.consumers.forensics._status_report import Cause, ProducersReport, PromptsReport, TrainerReport
from rollstream.infra import TopicNames
from rollstream.schemas import OffsetDisposition, now_ms

_KIND_ORDER = ("taken", "filtered", "requeued", "duplicate", "undecodable")
_REASON_KINDS = frozenset({"filtered", "requeued"})  # kinds whose reason label is worth counting


def by_kind(dispositions: Iterable[OffsetDisposition]) -> dict[str, dict[str, int]]:
    """kind -> label -> count; the label is the reason's (`reason_label`) for filtered and requeued, else the kind."""
    counts: dict[str, Counter[str]] = {}
    for d in dispositions:
        label = reason_label(d.reason or "") if d.kind in _REASON_KINDS else d.kind
        counts.setdefault(d.kind, Counter())[label] += 1
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    return {k: ranked(counts[k]) for k in sorted(counts, key=lambda k: (order.get(k, 99), k))}


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


def ranked(counts: Mapping[str, int]) -> dict[str, int]:
    """Most first, ties by name: the same text for the same counts."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _labels(labels: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in ranked(labels).items())


def skipped_cause(labels: Mapping[str, int], total: int, *, what: str, filtered_only: bool,
                  max_staleness: int | None, policy_version: int | None, failure: str | None = None) -> Cause:
    """The all-skipped cause; `what` names the groups, ``{}`` where "filtered" or "skipped" goes; `failure` is the
    first failed group's reason (the producer's error says what to change: the reason is worth reading whole)."""
    word = "filtered" if filtered_only else "skipped"
    stale = (f" (max_staleness={max_staleness}, policy version {policy_version})"
             if "stale" in labels and max_staleness is not None else "")
    first = f"; the first {failure}" if failure else ""
    return Cause("all_skipped", True, f"{what.format(word)}: {_labels(labels)}{stale}{first}")


def take_cause(dispositions: Sequence[OffsetDisposition], max_staleness: int | None,
               policy_version: int | None) -> Cause | None:
    """The all-skipped cause when a take looked at groups and took none of them."""
    if not dispositions or any(d.kind == "taken" for d in dispositions):
        return None
    labels: Counter[str] = Counter()
    for kind_labels in by_kind(dispositions).values():
        labels.update(kind_labels)
    n = len(dispositions)
    failure = next((d.reason for d in dispositions if reason_label(d.reason or "") == "failed"), None)
    return skipped_cause(labels, n, what=f"the last {n} group{'s' if n != 1 else ''} looked at "
                         f"{'were all' if n != 1 else 'was'} {{}}", filtered_only=all(d.kind in _REASON_KINDS
                                                                                for d in dispositions),
                         max_staleness=max_staleness, policy_version=policy_version, failure=failure)


def causes_of(names: TopicNames, producer_group: str, producers: ProducersReport | None,
              prompts: PromptsReport | None, trainer: TrainerReport | None,
              first: Cause | None = None, *, trainer_group: str | None = None) -> tuple[Cause, ...]:
    """Every cause the parts show (None: not read), blocking ones first; `first` (a take's own) leads, then a
    trainer group the producers do not follow (`trainer_group`: the one waiting; None: not checked)."""
    out: list[Cause] = [first] if first else []
    if trainer_group is not None and (mismatch := _group_mismatch(producer_group, producers, trainer_group)):
        out.append(mismatch)
    if first is None and trainer is not None and (cause := _waiting_cause(trainer)) is not None:
        out.append(cause)
    out += _prompt_causes(names.namespace, producer_group, prompts)
    out += _producer_causes(names.namespace, producer_group, producers, prompts.left if prompts else None)
    return tuple(sorted(out, key=lambda c: (c is not first, c.code != "trainer_group_mismatch", not c.blocking)))


def _group_mismatch(producer_group: str, producers: ProducersReport | None, trainer_group: str) -> Cause | None:
    """Producers whose backpressure follows another trainer group than the one waiting: they never see its
    commits, so once their max lag is reached they pause for good."""
    followed = sorted({m.state.trainer_group for m in (producers.members if producers else ())
                       if m.state is not None and m.state.trainer_group not in (None, trainer_group)})
    if not followed:
        return None
    return Cause("trainer_group_mismatch", True, f"trainer group mismatch: the producers in {producer_group} gate on "
                 f"trainer group {', '.join(followed)}, but this trainer commits as {trainer_group}, so their "
                 f"backpressure never sees its commits: start the producers with --trainer-group {trainer_group} "
                 f"(or ROLLSTREAM_TRAINER_GROUP), or the trainer with --group {followed[0]}")


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


def unavailable_note(unavailable: Mapping[str, str]) -> str | None:
    if not unavailable:
        return None
    return "; ".join(f"could not read {part}: {why}" for part, why in unavailable.items())


def age(at_ms: int) -> str:
    """How long ago `at_ms` was, for people: ``850 ms``, ``12 s``, ``3.5 min``, ``2.0 h``."""
    s = max(0, now_ms() - at_ms) / 1000
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 \
        else f"{s / 3600:.1f} h"

