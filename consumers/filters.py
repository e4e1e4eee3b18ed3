"""Group filters: which decoded groups the trainer does not train on, and why.

A filter is any callable ``(group, context) -> reason | None``. It returns None to accept the group
or a short reason string to skip it. A skipped group is never silently dropped: its offset is
recorded in the step manifest as ``filtered`` with that reason, and counted in the
``rollstream_consumer_groups_filtered_total{reason=...}`` metric, labelled by the reason's text
before the first ``:`` (so ``"failed: engine timeout"`` is counted as ``failed``). Keep that prefix a
small, fixed vocabulary.

Filters run in order; the first reason wins. Built-ins (`default_filters`):

- `failed_group`: the producer published the group as failed (``status == "failed"``).
- `reward_missing`: a group with no samples, or a sample without a reward.
- `all_rewards_equal`: every sample has the same reward (DAPO dynamic sampling: GRPO advantages would
  all be zero). Only groups of two or more samples; turn it off with
  ``default_filters(dynamic_sampling=False)``.
- `stale`: the policy that generated the group's oldest sample is more than ``max_staleness``
  versions behind the trainer's current policy version. Inactive while either is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rollstream.schemas import ScoredGroup


@dataclass(frozen=True)
class FilterContext:
    """What a filter may know besides the group itself.

    Attributes:
        policy_version: the trainer's current policy version (None until the trainer sets one).
        max_staleness: the largest accepted ``policy_version - weight_version`` (None: no limit).
        partition, offset: where the record sits on the rollouts topic.
        consumer_group: the trainer's consumer group.
    """

    policy_version: int | None
    max_staleness: int | None
    partition: int
    offset: int
    consumer_group: str


GroupFilter = Callable[[ScoredGroup, FilterContext], "str | None"]


def failed_group(group: ScoredGroup, context: FilterContext) -> str | None:
    """Skip groups the producer gave up on (engine or reward error, oversize); reason ``failed: <error>``."""
    if group.status == "failed":
        return f"failed: {group.error}"
    return None


def reward_missing(group: ScoredGroup, context: FilterContext) -> str | None:
    """Skip a group without samples (``no_samples``) or with an unscored sample (``reward_missing``)."""
    rewards = group.rewards
    if not rewards:
        return "no_samples"
    if None in rewards:
        return "reward_missing"
    return None


def all_rewards_equal(group: ScoredGroup, context: FilterContext) -> str | None:
    """DAPO dynamic sampling: skip a group of 2+ samples whose rewards are all equal (zero advantage)."""
    rewards = group.rewards
    if len(rewards) >= 2 and None not in rewards and min(rewards) == max(rewards):  # type: ignore[type-var]
        return "all_rewards_equal"
    return None


def staleness_of(group: ScoredGroup, policy_version: int | None) -> int | None:
    """``policy_version`` minus the group's oldest weight version; None when either is unknown."""
    oldest = group.oldest_weight_version
    if policy_version is None or oldest is None:
        return None
    return policy_version - oldest


def stale(group: ScoredGroup, context: FilterContext) -> str | None:
    """Skip a group more than ``max_staleness`` policy versions behind; reason ``stale: N versions behind``."""
    if context.max_staleness is None:
        return None
    lag = staleness_of(group, context.policy_version)
    if lag is not None and lag > context.max_staleness:
        return f"stale: {lag} versions behind (max {context.max_staleness})"
    return None


def default_filters(*, dynamic_sampling: bool = True) -> tuple[GroupFilter, ...]:
    """The built-in filters in order: failed, reward missing, [all rewards equal], stale."""
    chosen: list[GroupFilter] = [failed_group, reward_missing]
    if dynamic_sampling:
        chosen.append(all_rewards_equal)
    chosen.append(stale)
    return tuple(chosen)


def reason_label(reason: str) -> str:
    """The metric label of a reason: its text before the first ``:`` (a small fixed vocabulary)."""
    return reason.partition(":")[0].strip() or "unnamed"


def filter_name(f: GroupFilter) -> str:
    return getattr(f, "__qualname__", None) or type(f).__name__
