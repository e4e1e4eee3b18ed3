"""What `rollstream status` reports and what a `TakeTimeout` carries: the report types, plain frozen data.

Read by `_status_read`, judged by `_status_causes`, assembled by
`rollstream.consumers.forensics._status.status`; `StatusReport.to_json` is the ``rollstream status --json`` document.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rollstream.infra.producer_state import ProducerState

PARTS: tuple[str, ...] = ("producers", "prompts", "trainer")


@dataclass(frozen=True)
class ProducerInfo:
    """One producer: a member of the producers' group now, or (`member_id` None) one that committed a state
    and is no longer a member.

    Attributes:
        producer_id: the member's ``group.instance.id`` (``--producer-id``), else the id in its committed state.
        member_id, client_id, host: as the group coordinator knows the member (None for a producer gone).
        partitions: NS.prompts partitions assigned to it (a producer gone: those its state is committed on).
        state: its newest committed `ProducerState` (None: it committed none yet).
    """

    producer_id: str | None
    member_id: str | None
    client_id: str | None
    host: str | None
    partitions: tuple[int, ...]
    state: ProducerState | None

    @property
    def paused(self) -> bool:
        return self.state is not None and self.state.paused


@dataclass(frozen=True)
class ProducersReport:
    """The producers' consumer group: its state (STABLE, EMPTY, DEAD, ...), members, producers gone."""

    group: str
    group_state: str
    members: tuple[ProducerInfo, ...]
    gone: tuple[ProducerInfo, ...]

    @property
    def paused(self) -> tuple[ProducerInfo, ...]:
        return tuple(m for m in self.members if m.paused)


@dataclass(frozen=True)
class EpochPrompts:
    """Prompts of one epoch left on NS.prompts; `requeued` of them were published again (attempt > 0)."""

    epoch: int
    left: int
    requeued: int


@dataclass(frozen=True)
class PromptsReport:
    """NS.prompts as the producers' group stands.

    Attributes:
        stored: records the topic holds now.
        left: records past the producers' committed offsets: not generated yet, or being generated (exact).
        epochs: the `left` records read, by epoch (all of them when `complete`, else a lower bound).
        read: how many of `left` were read; undecodable: how many of those were no Prompt.
        last_epoch: the newest epoch seen (of the records read, else of each partition's last record).
    """

    topic: str
    stored: int
    left: int
    epochs: tuple[EpochPrompts, ...]
    read: int
    undecodable: int
    last_epoch: int | None

    @property
    def complete(self) -> bool:
        return self.read >= self.left


@dataclass(frozen=True)
class WaitingGroups:
    """The next groups past the trainer group's committed offsets, judged as a take would judge them
    (default filters, dedupe against the steps read); `skipped` counts by reason label."""

    looked_at: int
    acceptable: int
    skipped: dict[str, int]
    max_staleness: int | None
    policy_version: int | None


@dataclass(frozen=True)
class TrainerReport:
    """The trainer group on NS.rollouts and NS.steps.

    Attributes:
        lag: committed lag on NS.rollouts (`rollstream.infra.LagReader`); committed: per partition (None: nothing).
        last_step, last_step_at_ms, policy_version: the newest effective step, when it was taken, at which
            policy version (None: no step found).
        recent_steps: the step numbers counted in `recent` (kind -> reason label -> offsets).
        pending_steps: steps whose manifest is written but whose offsets are not committed.
        steps_read_all: False when only the newest records of NS.steps were read.
        waiting: the peek at the next groups (None when the lag is 0 or the peek is off).
        followed_version, followed_run, followed_at_ms: the policy announcement producers follow now
            (`rollstream.infra.runs`: the newest trainer run's latest; None: nothing announced or unread).
        superseded_announcements: announcements of superseded trainer runs on NS.control (they moved nobody).
    """

    group: str
    topic: str
    lag: int
    committed: dict[int, int | None]
    last_step: int | None
    last_step_at_ms: int | None
    policy_version: int | None
    recent_steps: tuple[int, ...]
    recent: dict[str, dict[str, int]]
    pending_steps: tuple[int, ...]
    steps_read_all: bool
    waiting: WaitingGroups | None
    followed_version: int | None = None
    followed_run: int | None = None
    followed_at_ms: int | None = None
    superseded_announcements: int = 0


@dataclass(frozen=True)
class Cause:
    """One finding. `code`: no_prompts | prompts_exhausted | no_producer | producers_paused | all_skipped |
    trainer_group_mismatch | flowing. `blocking`: work is left that cannot reach a waiting trainer until someone
    acts."""

    code: str
    blocking: bool
    message: str


@dataclass(frozen=True)
class Diagnosis:
    """Likely causes of a wait, most telling first; `seen` is what a timed-out take itself looked at, `note`
    what limits the diagnosis (parts unreadable, an older read), `read_at_ms` when the cluster was read."""

    causes: tuple[Cause, ...] = ()
    seen: str | None = None
    note: str | None = None
    read_at_ms: int | None = None

    @property
    def blocked(self) -> bool:
        return any(c.blocking for c in self.causes)

    def why(self, most: int = 2) -> str:
        """The first `most` causes in one line (and the note)."""
        text = "; ".join(c.message for c in self.causes[:most]) or "no cause found"
        return f"{text} ({self.note})" if self.note else text

    def __str__(self) -> str:
        seen = f"This take {self.seen}.\n" if self.seen else ""
        return f"{seen}Why: {self.why()}"


@dataclass(frozen=True)
class StatusReport:
    """What `status` read, what it could not read (`unavailable`: part -> why) and its `diagnosis`."""

    namespace: str
    producer_group: str
    trainer_group: str
    read_at_ms: int
    producers: ProducersReport | None
    prompts: PromptsReport | None
    trainer: TrainerReport | None
    unavailable: dict[str, str]
    diagnosis: Diagnosis = field(default_factory=Diagnosis)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON-able dicts and lists (`json.dumps` ready); computed flags added."""
        out = asdict(self)
        out["diagnosis"]["blocked"] = self.diagnosis.blocked
        if self.prompts is not None:
            out["prompts"]["complete"] = self.prompts.complete
        return out

