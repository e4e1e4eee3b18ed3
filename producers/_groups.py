"""From a taken prompt and what became of it to the bytes of its `ScoredGroup` record. Pure functions.

A group's stages (`rollstream.producers._pipeline`) end in an `Outcome`: ok, or failed with its error (the prompt
did not decode, the engine gave up, the reward raised). `record_of` turns a taken prompt and its outcome
into the record in one of four shapes, and `encode_within` tries them in order until one encodes within
the topic's limit, so every prompt is accounted by exactly one record:

1. ``full``: the outcome as it is: an ok group with its scored samples, or a failed one with the samples
   it has (unscored when scoring failed) and its error.
2. ``with_samples``: failed, with the samples and prompt tokens, carrying why ``full`` could not be used.
3. ``stripped``: failed, without prompt tokens or samples (they are what could not be shipped).
4. ``bare``: failed, without the prompt's metadata either, and a short error: what a poison prompt (its
   metadata alone beyond the limit) is accounted by, so it never stops its partition. This last shape
   is returned whatever its size: the broker is the final judge.

Every record of a decoded prompt carries the producer's sampling parameters (`sampling_of`): the trainer
recomputes logprobs at that temperature. A sample carries its completion's loss mask (tool and
environment tokens 0), version spans and resume points (where generation resumed from another producer's
in-flight checkpoint, and whose); without spans, the one version `rollstream.producers.policy` stamped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from rollstream.producers.engines.base import Completion, Generation, SamplingParams
from rollstream.producers.intake import TakenPrompt
from rollstream.schemas import (
    InvalidRecordError,
    Prompt,
    Sample,
    Samples,
    Sampling,
    ScoredGroup,
    encode,
    float32_array,
    int32_array,
    make_group_id,
    now_ms,
    plain_samples,
)

log = logging.getLogger(__name__)
Shape = Literal["full", "with_samples", "stripped", "bare"]
SHAPES: tuple[Shape, ...] = ("full", "with_samples", "stripped", "bare")
_MAX_ERROR_CHARS = 10_000
_BARE_ERROR_CHARS = 1_000


@dataclass(frozen=True)
class Outcome:
    """What a group's stages came to.

    Attributes:
        generation: the engine's output (None when generation failed or never ran).
        rewards: one per completion (None: not scored, because scoring failed or never ran).
        versions: the policy version of each completion (see `rollstream.producers.policy`).
        policy_run: the trainer run those versions belong to (the one followed when the generation started).
        error: None when ok; else what failed, e.g. ``generation failed: ...``.
        retriable: the failure may pass (an engine timeout or restart, a reward that timed out): another
            attempt of the prompt is worth it (the trainer requeues it, see `ScoredGroup.max_attempts`).
    """

    generation: Generation | None = None
    rewards: Sequence[float | None] | None = None
    versions: Sequence[int] = ()
    policy_run: int = 0
    error: str | None = None
    retriable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def sampling_of(params: SamplingParams) -> Sampling:
    """The sampling parameters to record: what the engine receives (`SamplingParams.to_dict`, so a
    ``top_k`` passed through ``extra`` counts). Raises InvalidRecordError when out of range."""
    sent = params.to_dict()
    try:
        return Sampling(temperature=float(sent["temperature"]), top_p=float(sent["top_p"]),
                        top_k=int(sent.get("top_k", -1)))
    except (TypeError, ValueError) as exc:
        raise InvalidRecordError(f"sampling parameters {sent} do not fit the record: {exc}") from exc


def record_of(taken: TakenPrompt, outcome: Outcome, shape: Shape, *, producer_id: str,
              prompts_topic: str, sampling: Sampling | None = None, max_attempts: int = 1) -> ScoredGroup:
    """The record for `taken` in `shape` (see the module docstring), with `sampling` recorded, the
    prompt's attempt and `max_attempts`, and the prompt record as read (what a requeue republishes).
    Only a failure of the outcome itself (not a shape that could not ship) is retriable.

    Raises:
        InvalidRecordError: the generation does not fit the schema (e.g. a token id beyond int32).
    """
    if taken.prompt is None:
        return _undecodable(taken, prompts_topic, producer_id)
    prompt = taken.prompt
    small = shape in ("stripped", "bare")
    generation = None if small else outcome.generation  # stripped: what could not be shipped
    failed = not (outcome.ok and shape == "full")
    text = "" if small else (generation.prompt_text if generation else "") or _prompt_text(prompt)
    error = (outcome.error or "")[:_BARE_ERROR_CHARS if shape == "bare" else _MAX_ERROR_CHARS]
    return ScoredGroup(
        group_id=prompt.group_id, prompt_id=prompt.id, epoch=prompt.epoch, prompt=text,
        prompt_tokens=int32_array(generation.prompt_tokens if generation else (), "prompt_tokens"),
        samples=_samples(generation, outcome) if generation else Samples(()), started_at_ms=taken.taken_at_ms,
        finished_at_ms=now_ms(), producer_id=producer_id, status="failed" if failed else "ok",
        error=error if failed else None, metadata={} if shape == "bare" else prompt.metadata, sampling=sampling,
        attempt=prompt.attempt, max_attempts=max_attempts, retriable=failed and outcome.retriable,
        source_prompt=taken.value, policy_run=outcome.policy_run)


def encode_within(taken: TakenPrompt, outcome: Outcome, limit: int, *, producer_id: str, prompts_topic: str,
                  shapes: Sequence[Shape] = SHAPES, sampling: Sampling | None = None,
                  max_attempts: int = 1) -> tuple[ScoredGroup, bytes]:
    """The first of `shapes` of `taken`'s record that builds, encodes and fits `limit` bytes, with its bytes.

    Each fallback carries why the shape before it could not be used. The last shape is returned whatever
    its size (a broker that refuses the bare record stops the producer: nothing smaller exists). An oversize
    group is logged once, with the size of its first shape (the group as generated).
    """
    oversized = False
    for shape in shapes:
        try:
            group = record_of(taken, outcome, shape, producer_id=producer_id, prompts_topic=prompts_topic,
                              sampling=sampling, max_attempts=max_attempts)
            # nbytes (the packed tokens alone) is a lower bound of the record's size: beyond the limit,
            # encoding is not worth it. The last shape is always encoded.
            last = shape == shapes[-1]
            value = b"" if not last and group.nbytes > limit else encode(group)
        except InvalidRecordError as exc:
            log.warning("group of %s cannot be encoded as %s (%s): falling back", _where(taken, prompts_topic),
                        shape, exc)
            error = f"cannot encode group: {exc}"
            outcome = replace(outcome, error=f"{outcome.error}; {error}" if outcome.error else error, retriable=False)
            continue
        if value and (len(value) <= limit or last):
            return group, value
        if not oversized:
            oversized = True
            error = oversize_error(len(value) or group.nbytes, limit, prompts_topic.removesuffix(".prompts"))
            log.warning("group of %s published as failed: %s", _where(taken, prompts_topic), error)
            outcome = replace(outcome, error=error, retriable=False)
    raise InvalidRecordError(f"no record of {_where(taken, prompts_topic)} could be encoded: {outcome.error}")


def oversize_error(size: int, limit: int, namespace: str) -> str:
    """Why a group did not fit its topic, and both fixes: a larger topic limit (which the producers read at start)
    or a smaller group."""
    mib = -(-size * 5 // 4 // (1 << 20))  # a quarter to spare, whole MiB
    return (f"group record of {size} bytes exceeds max_message_bytes={limit} (max.message.bytes of "
            f"{namespace}.rollouts): raise it to {mib} MiB with 'rollstream topics alter --namespace {namespace} "
            f"--max-message-mib {mib}' and restart the producers, or make groups smaller (--n-samples, "
            "--max-new-tokens)")


def _samples(generation: Generation, outcome: Outcome) -> Samples:
    """The samples of `generation`: plain responses as columns at once (`rollstream.schemas.plain_samples`: no
    `Sample` object per response), else a `Sample` each (loss masks, version spans, resume points, or a value
    that only the per-sample checks can name)."""
    completions = generation.completions
    rewards = outcome.rewards if outcome.rewards is not None else [None] * len(completions)
    versions = outcome.versions or [0] * len(completions)
    if all(c.loss_mask is None and not c.version_spans and not len(c.resume_points) for c in completions):
        plain = plain_samples([c.tokens for c in completions], [c.logprobs for c in completions],
                              [c.text for c in completions], rewards, [c.finish_reason for c in completions],
                              versions)
        if plain is not None:
            return plain
    return Samples([_sample(c, r, v) for c, r, v in zip(completions, rewards, versions, strict=True)])


def _sample(c: Completion, reward: float | None, version: int) -> Sample:
    """`c` as a sample: its version spans when the engine gave them (they name every version), else `version`,
    and its resume points with the producers they resumed from."""
    return Sample(tokens=int32_array(c.tokens, "tokens"), text=c.text, logprobs=float32_array(c.logprobs, "logprobs"),
                  reward=reward, finish_reason=c.finish_reason, weight_versions=() if c.version_spans else (version,),
                  loss_mask=None if c.loss_mask is None else np.asarray(c.loss_mask),
                  version_spans=tuple(c.version_spans), resume_points=tuple(c.resume_points),
                  resumed_from=tuple(c.resumed_from))


def _undecodable(taken: TakenPrompt, prompts_topic: str, producer_id: str) -> ScoredGroup:
    """A failed group standing for a prompt record that could not be decoded, so it is accounted too."""
    prompt_id = f"undecodable:{prompts_topic}:{taken.partition}:{taken.offset}"
    return ScoredGroup(group_id=make_group_id(prompt_id, 0), prompt_id=prompt_id, epoch=0, prompt="",
                       prompt_tokens=int32_array((), "prompt_tokens"), samples=Samples(()),
                       started_at_ms=taken.taken_at_ms, finished_at_ms=now_ms(), producer_id=producer_id,
                       status="failed", error=f"undecodable prompt: {taken.error or ''}"[:_MAX_ERROR_CHARS])


def _prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt.prompt, str):
        return prompt.prompt
    return "\n".join(f"{m.role}: {m.content}" for m in prompt.prompt)


def _where(taken: TakenPrompt, prompts_topic: str) -> str:
    return f"{prompts_topic}[{taken.partition}]@{taken.offset}"
