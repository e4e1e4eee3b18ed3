"""Requeue instead of burn: a group skipped for a passing reason gets its prompt published again.

A group filtered as ``stale`` (the policy moved on while it was generated), or one that ``failed`` for
a reason that may pass (`ScoredGroup.retriable`: an engine timeout, a server restart), says nothing
about its prompt: dropping it would burn the prompt out of its epoch and bias training towards
prompts that generate fast. So the trainer republishes the prompt record the group came from
(`ScoredGroup.source_prompt`) to NS.prompts with its attempt raised, keyed by prompt id like the
original; a producer regenerates it under the same group id, and the regenerated group is taken
like any other (dedupe skips only ids that were *taken*). The step manifest records the offset as
``requeued`` with its reason and attempt. Once ``attempt + 1`` reaches the producer's
``max_attempts`` (stamped on the group), the reason is terminal: the offset is ``filtered``, its
reason saying it was the last attempt. Filters that reflect the data (all rewards equal, no reward)
are terminal at once.

Requeue is idempotent where it matters: the requeue records of a step are acknowledged before its
manifest is written (`rollstream.consumers._commit`), and a step recorded before a crash is taken again as
recorded, without republishing. A take that times out publishes the requeues it found at once (the
groups it waits for may be the regenerated ones) and remembers where: the next take records those
offsets as ``requeued`` without publishing them again. A crash after the requeue and before the
manifest republishes it on the next take: the prompt is then generated twice, and the second group
is a ``duplicate`` (the same id as the first, taken; or, when stale too, "already requeued" at that
attempt). Never two trained groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rollstream.consumers.filters import reason_label
from rollstream.schemas import Prompt, SchemaError, ScoredGroup, decode, encode

REQUEUE_LABELS = ("stale", "failed")  # reason labels that may pass; "failed" only when the group is retriable


@dataclass(frozen=True)
class Requeue:
    """A prompt to publish again: `value` is the Prompt record at `attempt`, keyed by `key` (its id), for
    the group at `partition`/`offset` of NS.rollouts."""

    group_id: str
    attempt: int
    key: bytes
    value: bytes
    partition: int
    offset: int


def passing(group: ScoredGroup, reason: str) -> bool:
    """Whether `reason` (a filter's) may pass on another attempt of `group`'s prompt."""
    label = reason_label(reason)
    return label == "stale" or (label == "failed" and group.retriable)


def requeue_of(group: ScoredGroup, reason: str, partition: int, offset: int) -> Requeue | None:
    """The requeue of `group` skipped for `reason`, or None when the reason is terminal: it reflects the
    data, the last attempt was made, or the group carries no prompt record to republish."""
    if not passing(group, reason) or group.attempt + 1 >= group.max_attempts or not group.source_prompt:
        return None
    try:
        prompt = decode(group.source_prompt, Prompt)
    except SchemaError:
        return None
    again = replace(prompt, attempt=group.attempt + 1)
    return Requeue(group.group_id, again.attempt, again.id.encode(), encode(again), partition, offset)


def terminal_reason(group: ScoredGroup, reason: str) -> str:
    """`reason` as recorded when it is final; a passing reason says why it was not requeued."""
    if not passing(group, reason) or group.max_attempts <= 1:
        return reason
    if group.attempt + 1 >= group.max_attempts:
        return f"{reason} (attempt {group.attempt + 1} of {group.max_attempts}: the last)"
    return f"{reason} (not requeued: the group carries no readable prompt record)"
