"""What every trainer adapter shares (slime and TRL today, verl next): the group-size filter and one step's
metrics. Each adapter keeps only what its trainer dictates: how it is called, the names its logger expects.

Pinned by tests/unit/test_trainer_adapters.py: the filter's reason, and the metrics of a batch with taken,
filtered, requeued and stale groups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from rollstream.consumers._batch import Batch
from rollstream.consumers.filters import FilterContext, GroupFilter, reason_label, staleness_of
from rollstream.schemas import ScoredGroup


def group_size_filter(expected: int | None, *, trainer: str, setting: str) -> GroupFilter:
    """A filter that skips a group of other than `expected` samples (None: any size), with the reason
    ``group_size: K samples, <trainer> expects <setting>=<expected>`` (recorded in the step's manifest)."""

    def group_size(group: ScoredGroup, context: FilterContext) -> str | None:
        if expected is not None and len(group.samples) != expected:
            return f"group_size: {len(group.samples)} samples, {trainer} expects {setting}={expected}"
        return None

    return group_size


@dataclass(frozen=True)
class StepMetrics:
    """One taken step, counted for a trainer's logger. `staleness`: the trainer's version minus each taken
    group's oldest weight version (groups without versions are left out)."""

    step: int
    weight_version: int
    lag: int
    counts: Mapping[str, int]  # taken, filtered, requeued, duplicate, undecodable (`Batch.counts`)
    filtered_by_reason: Mapping[str, int] = field(default_factory=dict)  # by `reason_label`
    staleness: tuple[int, ...] = ()

    @classmethod
    def of(cls, batch: Batch, weight_version: int, lag: int) -> StepMetrics:
        reasons = Counter(reason_label(d.reason or "") for d in batch.dispositions if d.kind == "filtered")
        stale = tuple(s for g in batch.groups if (s := staleness_of(g, weight_version)) is not None)
        return cls(batch.step, weight_version, lag, batch.counts(), dict(reasons), stale)

    @property
    def staleness_mean(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.staleness, default=0)
