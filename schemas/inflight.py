"""`InflightCheckpoint`: the state of one sample being generated, as a producer checkpoints it on NS.inflight.

A checkpoint is written at each turn boundary of a multi-turn episode (and when a sample finishes), keyed
``GROUP_ID/SAMPLE_INDEX`` on the compacted NS.inflight, so the newest state of each sample wins; the producer
that publishes the group writes a tombstone for each key. A producer that takes the prompt over after a
crash continues each sample from its newest checkpoint (`rollstream.producers._inflight`). The domain, not
the wire: `_layout` lays it out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from rollstream.schemas._errors import InvalidRecordError
from rollstream.schemas._packing import float32_array, int32_array


def checkpoint_key(group_id: str, sample_index: int) -> str:
    """The NS.inflight key of one sample of a group: ``GROUP_ID/SAMPLE_INDEX``."""
    return f"{group_id}/{sample_index}"


@dataclass(frozen=True)
class InflightCheckpoint:
    """One sample of a group as far as it was generated.

    Attributes:
        tokens: the response so far (int32); `logprobs` one per token (float32) or None; `loss_mask` one 0/1
            per token or None (all 1); `versions` the policy version of each token (-1: unknown).
        finish_reason: None while the sample is generated; ``stop``/``length`` once it finished (kept as is).
        policy_turns: policy turns taken (a multi-turn episode; 0 for a single generation).
        environment_state: the environment's ``snapshot()`` after the last turn, or None (no snapshot: an
            episode restarts).
        resume_points, resumed_from: token indices where the sample was resumed before, and whose checkpoint
            each resume continued.
        text: the response so far, decoded, where the engine keeps it (a single generation); else empty.
        prompt_tokens: the prompt's token ids the sample continues (int32), or None: not known (a text prompt
            whose ids the engine never saw; its sample cannot be continued and restarts).
    Raises:
        InvalidRecordError: per-token fields of another length than `tokens`, or resume points that are not
            ascending indices within it, one producer each.
    """

    group_id: str
    prompt_id: str
    attempt: int
    sample_index: int
    prompt_partition: int
    prompt_offset: int
    producer_id: str
    written_at_ms: int
    policy_run: int
    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    loss_mask: np.ndarray | None = None
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    finish_reason: str | None = None
    policy_turns: int = 0
    environment_state: bytes | None = None
    resume_points: tuple[int, ...] = ()
    resumed_from: tuple[str, ...] = ()
    text: str = ""
    prompt_tokens: np.ndarray | None = None

    def __post_init__(self) -> None:
        tokens = int32_array(self.tokens, "tokens")
        object.__setattr__(self, "tokens", tokens)
        if self.prompt_tokens is not None:
            object.__setattr__(self, "prompt_tokens", int32_array(self.prompt_tokens, "prompt_tokens"))
        object.__setattr__(self, "logprobs", float32_array(self.logprobs, "logprobs"))
        if self.loss_mask is not None:
            object.__setattr__(self, "loss_mask", np.asarray(self.loss_mask, dtype=np.uint8))
        object.__setattr__(self, "versions", np.asarray(self.versions, dtype=np.int64))
        object.__setattr__(self, "resume_points", tuple(int(p) for p in self.resume_points))
        object.__setattr__(self, "resumed_from", tuple(str(p) for p in self.resumed_from))
        n = len(tokens)
        for name in ("logprobs", "loss_mask", "versions"):
            value = getattr(self, name)
            if value is not None and len(value) != n and not (name == "versions" and len(value) == 0):
                raise InvalidRecordError(f"checkpoint {self.key}: {name} has {len(value)} entries for {n} tokens")
        points = self.resume_points
        if (len(points) != len(self.resumed_from) or any(not 0 <= p <= n for p in points)
                or list(points) != sorted(points)):
            raise InvalidRecordError(f"checkpoint {self.key}: resume points {list(points)} must be ascending indices "
                                     f"within its {n} tokens, with one producer each ({list(self.resumed_from)})")

    @property
    def key(self) -> str:
        return checkpoint_key(self.group_id, self.sample_index)

    def token_versions(self) -> list[int | None]:
        """The version of each token (None: unknown)."""
        if not len(self.versions):
            return [None] * len(self.tokens)
        return [None if v < 0 else int(v) for v in self.versions.tolist()]


def versions_array(versions: Sequence[int | None]) -> np.ndarray:
    """Per-token versions as a checkpoint stores them (-1: unknown)."""
    return np.asarray([-1 if v is None else v for v in versions], dtype=np.int64)
