"""What an engine saves of a group's samples while it generates them, and what it resumes them from.

A producer checkpoints the samples of the groups it generates on NS.inflight (`rollstream.producers._inflight`),
so that the producer that takes a prompt over after a crash continues each sample where it was, rather than
generating it again. An engine that declares ``saves_progress`` (`EngineCapabilities`) takes a keyword
``progress: Progress | None = None`` in ``generate``: it starts each sample from `Progress.restored` (None:
from scratch) and hands `Progress.save` the sample's state at each point worth keeping (a turn boundary of a
multi-turn episode, a finished sample). Saving never blocks and never fails the generation: the newest
state of a sample wins, written off the generation path. No Kafka here: the engine side only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SampleState:
    """One sample as far as it was generated.

    Attributes:
        tokens: the response so far; `logprobs` one per token (None: none); `loss_mask` one 0/1 per token
            (None: all 1); `versions` the policy version of each token (None: unknown).
        finish_reason: None while the sample is generated; ``stop`` or ``length`` once it finished.
        policy_turns: policy turns taken (a multi-turn episode).
        environment_state: the environment's ``snapshot()`` after the last turn (None: it has none, and a
            resumed episode starts again).
        resume_points, resumed_from: where the sample was resumed from a checkpoint (token indices), and the
            producer whose checkpoint each resume continued; a restored state ends in its own resume point.
        text: the response so far, decoded, where the engine has it (a single generation); else empty.
        prompt_ids: the prompt's token ids the sample continues, where the engine knows them (sent, or as the
            server tokenized a text prompt); None: not known.
    """

    tokens: Sequence[int]
    logprobs: Sequence[float] | None = None
    loss_mask: Sequence[int] | None = None
    versions: Sequence[int | None] = ()
    finish_reason: str | None = None
    policy_turns: int = 0
    environment_state: bytes | None = None
    resume_points: tuple[int, ...] = field(default=())
    resumed_from: tuple[str, ...] = field(default=())
    text: str = ""
    prompt_ids: Sequence[int] | None = None


class Progress(Protocol):
    """A group's checkpoints, as its engine sees them. Loop-only; never blocks.

    Attributes:
        interval_s: how often a long generation saves its state (an engine that streams it).
        version: the policy version the producer stamps this group's tokens with when the engine reports none:
            a resumed sample's new tokens take it, its restored ones keep their checkpoint's.
    """

    interval_s: float
    version: int

    def restored(self, index: int) -> SampleState | None:
        """The state sample `index` resumes from (its newest checkpoint, when another producer left one and it
        is still valid), or None: generate it from scratch."""
        ...

    def save(self, index: int, state: SampleState) -> None:
        """Checkpoint sample `index` as `state` (returns at once; the newest state of a sample wins)."""
        ...

    def restarted(self, index: int, why: str) -> None:
        """Sample `index` had a checkpoint the engine could not resume from (`why`): it starts again."""
        ...
