"""What `rollstream report` shows, gathered from the steps: per-step figures, and a few steps in full.

One pass over the steps (`_step_read.read_steps`: the reads export uses, bounded memory) builds a
`StepStats` per step and keeps the groups of the chosen `detail` steps whole (prompt, responses, rewards,
advantages, tokens). Exact, from the manifests and records: counts by disposition and reason, rewards,
advantages (`grpo_advantages`, as `to_tensors`), staleness (the step's trainer version minus a taken group's
oldest weight version), generation time (the group's own start and finish stamps).

Approximate, and said so on the page: **wait** is the step's manifest time minus the record's timestamp
(two clocks: the trainer's and the producer's); **lag** is the records published before the step's manifest
was written (`offsets_at`: by the records' timestamps) past the group's position after that step, looked up
for at most `MAX_LAG_LOOKUPS` steps spread over the range (the others are left empty).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rollstream.consumers.filters import reason_label
from rollstream.consumers.forensics._export import group_advantages
from rollstream.consumers.forensics._replay import offsets_at
from rollstream.consumers.forensics._step_read import Covered, CoveredStep
from rollstream.infra import KafkaConfig
from rollstream.infra.kafka_io import reader, watermarks
from rollstream.schemas import StepManifest

MAX_LAG_LOOKUPS = 400
MAX_TOKENS_SHOWN = 4096  # per sample on the page; the export has them all
MAX_STEP_TOKENS = 200_000  # per detail step on the page (~4 MB of HTML): later responses show their text only
TOP_PROMPTS = 20
TokenText = Callable[[Sequence[int]], list[str]]


@dataclass(frozen=True)
class StepStats:
    """One step's figures (None: nothing to measure, e.g. no taken group carried a version)."""

    step: int
    created_at_ms: int
    trainer_version: int | None
    counts: dict[str, int]
    reasons: dict[str, int]
    reward_mean: float | None
    flat_groups: int
    staleness_mean: float | None
    staleness_max: int | None
    wait_s_mean: float | None
    generation_s_mean: float | None
    response_tokens_mean: float | None
    position: dict[int, int] = field(repr=False, default_factory=dict)
    lag: int | None = None


@dataclass(frozen=True)
class ReportData:
    """Everything the page shows: per-step figures, the detail steps' groups, the prompts that never scored."""

    namespace: str
    consumer_group: str
    steps: tuple[StepStats, ...]
    details: dict[int, list[dict[str, Any]]]
    zero_prompts: list[dict[str, Any]]
    generated_at_ms: int


def collect(steps: Iterable[CoveredStep], detail: set[int], *, token_text: TokenText | None = None
            ) -> tuple[list[StepStats], dict[int, list[dict[str, Any]]], list[dict[str, Any]]]:
    """Per-step figures of `steps`, the groups of the `detail` steps in full, and the prompts whose every
    sample got reward 0 most often (taken or not). Reads `steps` once."""
    stats: list[StepStats] = []
    details: dict[int, list[dict[str, Any]]] = {}
    zero: Counter[str] = Counter()
    zero_text: dict[str, str] = {}
    position: dict[int, int] = {}
    for step in steps:
        m = step.manifest
        for r in m.ranges:
            position[r.partition] = max(position.get(r.partition, 0), r.end)
        stats.append(_stats(step, dict(position)))
        if m.step in detail:
            budget = [MAX_STEP_TOKENS]
            details[m.step] = [_group_view(c, m, token_text, budget) for c in step.records]
        for c in step.records:
            g = c.record.group
            if g is not None and g.samples and all(r == 0 for r in g.rewards):
                zero[g.prompt_id] += 1
                zero_text.setdefault(g.prompt_id, g.prompt[:200])
    top = [{"prompt_id": p, "groups": n, "prompt": zero_text[p]} for p, n in zero.most_common(TOP_PROMPTS)]
    return stats, details, top


def _stats(step: CoveredStep, position: dict[int, int]) -> StepStats:
    m = step.manifest
    counts = Counter(d.kind for d in m.dispositions)
    reasons = Counter(reason_label(d.reason or "") for d in m.dispositions if d.kind in ("filtered", "requeued"))
    taken = [(c.record, c.record.group) for c in step.records
             if c.disposition is not None and c.disposition.kind == "taken" and c.record.group is not None]
    groups = [g for _, g in taken if g is not None]
    rewards = [r for g in groups for r in g.rewards if r is not None]
    stale = [m.policy_version - v for g in groups
             if m.policy_version is not None and (v := g.oldest_weight_version) is not None]
    return StepStats(
        step=m.step, created_at_ms=m.created_at_ms, trainer_version=m.policy_version,
        counts={k: counts.get(k, 0) for k in ("taken", "filtered", "requeued", "duplicate", "undecodable")},
        reasons=dict(reasons), reward_mean=_mean(rewards),
        flat_groups=sum(1 for g in groups if len(set(g.rewards)) == 1),
        staleness_mean=_mean(stale), staleness_max=max(stale, default=None),
        wait_s_mean=_mean([(m.created_at_ms - record.timestamp_ms) / 1000 for record, _ in taken]),
        generation_s_mean=_mean([(g.finished_at_ms - g.started_at_ms) / 1000 for g in groups]),
        response_tokens_mean=_mean([len(s.tokens) for g in groups for s in g.samples]), position=position)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _group_view(covered: Covered, manifest: StepManifest, token_text: TokenText | None, budget: list[int]
                ) -> dict[str, Any]:
    """A JSON-ready view of one record of a detail step: the group and its samples with their tokens, as
    many as `budget[0]` (the step's tokens left to show) allows; `cut` marks a response shown in part, and
    `resumes` lists where its generation resumed from an in-flight checkpoint: [token index, producer id]."""
    d, g = covered.disposition, covered.record.group
    view: dict[str, Any] = {"offset": f"{covered.record.partition}:{covered.record.offset}",
                            "disposition": d.kind if d else None, "reason": d.reason if d else covered.record.error}
    if g is None:
        return view
    advantages = group_advantages(g)
    oldest, trainer = g.oldest_weight_version, manifest.policy_version
    view.update(group_id=g.group_id, prompt_id=g.prompt_id, prompt=g.prompt, attempt=g.attempt,
                producer=g.producer_id, status=g.status, error=g.error,
                staleness=None if oldest is None or trainer is None else trainer - oldest,
                generation_s=(g.finished_at_ms - g.started_at_ms) / 1000, samples=[])
    for s, advantage in zip(g.samples, advantages, strict=True):
        shown = min(len(s.tokens), MAX_TOKENS_SHOWN, budget[0])
        budget[0] -= shown
        tokens = s.tokens[:shown].tolist()
        view["samples"].append({
            "text": s.text, "reward": s.reward, "advantage": advantage, "finish": s.finish_reason,
            "version": s.weight_version, "tokens": tokens, "cut": len(s.tokens) > shown, "length": len(s.tokens),
            "logprobs": None if s.logprobs is None else [round(float(x), 4) for x in s.logprobs[:shown]],
            "mask": None if s.loss_mask is None else s.loss_mask[:shown].tolist(),
            "versions": s.token_versions()[:shown].tolist(),
            "resumes": [[point, producer] for point, producer in zip(s.resume_points, s.resumed_from, strict=True)],
            "pieces": token_text(tokens) if token_text is not None else None})
    return view


def with_lags(config: KafkaConfig, manifests: Sequence[StepManifest], stats: list[StepStats], *,
              timeout: float = 30.0) -> list[StepStats]:
    """`stats` with `lag` filled in for at most `MAX_LAG_LOOKUPS` steps spread evenly (see the module
    docstring: approximate). One reader; one broker round trip per step looked up. Blocks until done.

    Raises:
        KafkaIOError: a lookup failed.
    """
    if not stats:
        return stats
    topic, group = manifests[0].topic, manifests[0].consumer_group
    stride = max(1, -(-len(stats) // MAX_LAG_LOOKUPS))
    out = list(stats)
    with reader(config, group) as consumer:
        partitions = sorted({p for s in stats for p in s.position})
        first = {p: min(r.start for m in manifests for r in m.ranges if r.partition == p) for p in partitions}
        ends = {p: watermarks(consumer, topic, p, timeout=timeout)[1] for p in partitions}
        for i in range(0, len(stats), stride):
            s = stats[i]
            before = offsets_at(consumer, topic, ends, s.created_at_ms, timeout=timeout)
            out[i] = replace(s, lag=sum(max(0, before[p] - s.position.get(p, first[p])) for p in partitions))
    return out
