"""What one `take` returns: the groups of one training step, where they came from, and tensors.

torch is imported only inside `Batch.to_tensors`, so the consumer itself works without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollstream.consumers._requeue import Requeue
from rollstream.schemas import (
    DISPOSITION_KINDS,
    OffsetDisposition,
    PartitionRange,
    RollstreamError,
    ScoredGroup,
    StepManifest,
)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Batch:
    """The groups of one training step, in the order they were taken.

    Attributes:
        step: the step number (continues across restarts of the same consumer group).
        groups: exactly the n groups taken.
        positions: (partition, offset) of each group, aligned with `groups`.
        ranges: per partition touched, the offsets [start, end) this step covers (taken or not).
        dispositions: one entry per offset in `ranges`: taken / filtered / duplicate / undecodable.
        offsets: the consumer's position after this step on every partition (offset of the next
            record to read): what a trainer checkpoint stores and `RolloutConsumer.seek_to` restores.
        consumer_group, topic, policy_version: context written to the step manifest.
        requeues: the prompts this step publishes again (its ``requeued`` dispositions), before its
            manifest is written; empty for a recorded step taken again (published the first time).
    """

    step: int
    groups: tuple[ScoredGroup, ...]
    positions: tuple[tuple[int, int], ...]
    ranges: tuple[PartitionRange, ...]
    dispositions: tuple[OffsetDisposition, ...]
    offsets: Mapping[int, int]
    consumer_group: str
    topic: str
    policy_version: int | None = None
    created_at_ms: int = 0
    requeues: tuple[Requeue, ...] = field(default=(), repr=False)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    def counts(self) -> dict[str, int]:
        """Dispositions of this step by kind (taken, filtered, duplicate, undecodable, requeued)."""
        out: dict[str, int] = dict.fromkeys(DISPOSITION_KINDS, 0)
        for d in self.dispositions:
            out[d.kind] += 1
        return out

    def summary(self, seconds: float) -> str:
        """One log line about this step, taken in `seconds`: its counts, ranges and next offsets."""
        c = self.counts()
        return (f"step {self.step}: took {c['taken']} groups in {seconds:.3f} s (filtered {c['filtered']}, requeued "
                f"{c['requeued']}, duplicate {c['duplicate']}, undecodable {c['undecodable']}) from {self.topic} "
                f"ranges { {r.partition: (r.start, r.end) for r in self.ranges} }; next offsets {self.offsets}")

    def manifest(self) -> StepManifest:
        """The StepManifest this step is committed with."""
        return StepManifest(step=self.step, consumer_group=self.consumer_group, topic=self.topic,
                            ranges=self.ranges, dispositions=self.dispositions,
                            created_at_ms=self.created_at_ms, policy_version=self.policy_version)

    def to_tensors(self, pad_id: int = 0, *, eps: float = 1e-6, device: Any = None,
                   dtype: Any = None) -> TensorBatch:
        """One row per sample (groups in order, samples in order), right-padded to the longest row.

        Each row is ``prompt_tokens + response tokens``. See `TensorBatch` for every field. GRPO
        advantages are ``(reward - group mean) / (group std + eps)``, std unbiased (as torch's
        default); a group of one sample has std 0. Rollout logprobs and token versions sit at the
        positions of the response tokens they belong to (0 and -1 elsewhere, and where the engine
        returned none); a next-token loss that predicts position t from t-1 shifts them by one itself.
        The loss mask is 1 on the response tokens the policy generated: a sample's `loss_mask` (0 on
        tool and environment tokens of a multi-turn rollout) applies inside the response.

        Raises:
            RollstreamError: a sample has no reward (keep the `reward_missing` filter on), or the
                batch is empty.
        """
        return tensors_of(self.groups, pad_id=pad_id, eps=eps, device=device, dtype=dtype)


@dataclass(frozen=True)
class TensorBatch:
    """Padded torch tensors of a batch; B = total samples, L = longest prompt + response.

    Attributes:
        input_ids: [B, L] long, prompt + response, right-padded with `pad_id`.
        attention_mask: [B, L] long, 1 on real tokens.
        loss_mask: [B, L] float, 1 on the response tokens to train: the response mask times each
            sample's `loss_mask` (tool and environment tokens 0); 0 on prompt and padding.
        rewards: [B] float.
        advantages: [B] float, GRPO group-normalised.
        rollout_logprobs: [B, L] float, the engine's logprob of each response token at its position.
        token_versions: [B, L] long, the policy version that generated each response token, at its
            position as in `rollout_logprobs` (`Sample.token_versions`: from its version spans, else its
            one weight version); -1 on prompt and padding, and where the version is unknown.
        prompt_lengths, response_lengths: [B] long.
        group_index: [B] long, index into `Batch.groups` of each row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    token_versions: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    group_index: torch.Tensor = field(repr=False)


def grpo_advantages(rewards: Sequence[float], eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` over one group; std unbiased, 0 for a single sample."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
    return [(r - mean) / (std + eps) for r in rewards]


def _rewards_and_advantages(groups: Sequence[ScoredGroup], eps: float) -> tuple[list[float], list[float]]:
    rewards: list[float] = []
    advantages: list[float] = []
    for group in groups:
        group_rewards = []
        for j, s in enumerate(group.samples):
            if s.reward is None:
                raise RollstreamError(f"group {group.group_id} sample {j} has no reward; keep the "
                                      "reward_missing filter on, or score every sample")
            group_rewards.append(s.reward)
        rewards.extend(group_rewards)
        if group_rewards:
            advantages.extend(grpo_advantages(group_rewards, eps))
    return rewards, advantages


def tensors_of(groups: Sequence[ScoredGroup], *, pad_id: int = 0, eps: float = 1e-6, device: Any = None,
               dtype: Any = None) -> TensorBatch:
    """See `Batch.to_tensors`."""
    import torch

    rows = [(gi, group, sample) for gi, group in enumerate(groups) for sample in group.samples]
    if not rows:
        raise RollstreamError("cannot build tensors of a batch without samples")
    rewards, advantages = _rewards_and_advantages(groups, eps)
    float_dtype = dtype or torch.float32
    width = max(len(g.prompt_tokens) + len(s.tokens) for _, g, s in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=float_dtype)
    logprobs = torch.zeros((len(rows), width), dtype=float_dtype)
    versions = torch.full((len(rows), width), -1, dtype=torch.long)
    prompt_lengths, response_lengths = [], []
    for b, (_, group, sample) in enumerate(rows):
        p, r = len(group.prompt_tokens), len(sample.tokens)
        input_ids[b, :p] = torch.from_numpy(group.prompt_tokens.astype("int64"))
        input_ids[b, p:p + r] = torch.from_numpy(sample.tokens.astype("int64"))
        attention[b, :p + r] = 1
        if sample.loss_mask is None:
            loss_mask[b, p:p + r] = 1
        else:  # astype copies: torch wants a writable array, and decoded masks view the record's bytes
            loss_mask[b, p:p + r] = torch.from_numpy(sample.loss_mask.astype("float32"))
        if sample.logprobs is not None:
            logprobs[b, p:p + r] = torch.from_numpy(sample.logprobs.astype("float32"))
        if sample.weight_versions:
            versions[b, p:p + r] = torch.from_numpy(sample.token_versions().astype("int64"))
        prompt_lengths.append(p)
        response_lengths.append(r)
    out = TensorBatch(
        input_ids=input_ids, attention_mask=attention, loss_mask=loss_mask,
        rewards=torch.tensor(rewards, dtype=float_dtype), advantages=torch.tensor(advantages, dtype=float_dtype),
        rollout_logprobs=logprobs, token_versions=versions,
        prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.long),
        response_lengths=torch.tensor(response_lengths, dtype=torch.long),
        group_index=torch.tensor([gi for gi, _, _ in rows], dtype=torch.long),
    )
    if device is None:
        return out
    return TensorBatch(**{name: getattr(out, name).to(device) for name in TensorBatch.__dataclass_fields__})
