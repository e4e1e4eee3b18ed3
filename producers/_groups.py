"""Turning a prompt and its generation into the `ScoredGroup` record, ok or failed. Pure functions."""

from __future__ import annotations

from collections.abc import Sequence

from producers.engines.base import Completion, Generation
from schemas import Prompt, Sample, ScoredGroup, make_group_id, now_ms


def samples_of(generation: Generation, rewards: Sequence[float | None], default_version: int) -> list[Sample]:
    """One `Sample` per completion, stamped with the engine's version or else `default_version`.

    Raises:
        InvalidRecordError: a completion does not fit the schema (e.g. a token id beyond int32).
    """
    return [_sample(c, r, default_version) for c, r in zip(generation.completions, rewards, strict=True)]


def _sample(c: Completion, reward: float | None, default_version: int) -> Sample:
    version = c.weight_version if c.weight_version is not None else default_version
    return Sample(tokens=c.tokens, text=c.text, logprobs=c.logprobs,
                  reward=reward, finish_reason=c.finish_reason, weight_versions=(version,))


def ok_group(prompt: Prompt, generation: Generation, samples: Sequence[Sample], *, producer_id: str,
             started_at_ms: int) -> ScoredGroup:
    return ScoredGroup(group_id=prompt.group_id, prompt_id=prompt.id, epoch=prompt.epoch,
                       prompt=generation.prompt_text or _prompt_text(prompt),
                       prompt_tokens=generation.prompt_tokens, samples=tuple(samples),
                       started_at_ms=started_at_ms, finished_at_ms=now_ms(), producer_id=producer_id,
                       metadata=prompt.metadata)


def failed_group(prompt: Prompt, error: str, *, producer_id: str, started_at_ms: int,
                 generation: Generation | None = None, samples: Sequence[Sample] = ()) -> ScoredGroup:
    """A failed group: the error, and whatever samples exist (none when generation itself failed)."""
    return ScoredGroup(group_id=prompt.group_id, prompt_id=prompt.id, epoch=prompt.epoch,
                       prompt=(generation.prompt_text if generation else "") or _prompt_text(prompt),
                       prompt_tokens=list(generation.prompt_tokens) if generation else [],
                       samples=tuple(samples), started_at_ms=started_at_ms, finished_at_ms=now_ms(),
                       producer_id=producer_id, status="failed", error=error[:10_000], metadata=prompt.metadata)


def undecodable_group(topic: str, partition: int, offset: int, error: str, *, producer_id: str,
                      started_at_ms: int) -> ScoredGroup:
    """A failed group standing for a prompt record that could not be decoded, so it is accounted too."""
    prompt_id = f"undecodable:{topic}:{partition}:{offset}"
    return ScoredGroup(group_id=make_group_id(prompt_id, 0), prompt_id=prompt_id, epoch=0, prompt="",
                       prompt_tokens=[], samples=(), started_at_ms=started_at_ms, finished_at_ms=now_ms(),
                       producer_id=producer_id, status="failed", error=f"undecodable prompt: {error}"[:10_000])


def stripped_failed(group: ScoredGroup, error: str) -> ScoredGroup:
    """A failed stand-in for `group` without prompt tokens or samples (they are what could not be shipped)."""
    return ScoredGroup(group_id=group.group_id, prompt_id=group.prompt_id, epoch=group.epoch, prompt="",
                       prompt_tokens=[], samples=(), started_at_ms=group.started_at_ms,
                       finished_at_ms=group.finished_at_ms, producer_id=group.producer_id, status="failed",
                       error=error[:10_000], metadata=group.metadata)


def oversize_group(group: ScoredGroup, size: int, limit: int) -> ScoredGroup:
    """The failed stand-in for a group whose record exceeds the topic's max.message.bytes."""
    return stripped_failed(group, f"group record of {size} bytes exceeds max_message_bytes={limit}; reduce "
                                  "--n-samples or --max-new-tokens, or create topics with a larger --max-message-mib")


def _prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt.prompt, str):
        return prompt.prompt
    return "\n".join(f"{m.role}: {m.content}" for m in prompt.prompt)
