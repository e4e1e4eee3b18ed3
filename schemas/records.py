"""The records rollstream puts on Kafka, as frozen dataclasses: the domain, not the wire.

Token ids and logprobs are numpy arrays (int32 / float32); lists are accepted on construction and
converted. Constructors validate (InvalidRecordError names the field); a group's samples are `_samples`'
(one representation, one builder that checks every sample invariant). How each record is laid out on
the wire is `_layout`'s business, and older layouts are `_upgrade`'s; nothing here knows either.
`Prompt.plugin_dict` is the dict plug-in generate and reward functions receive: a contract of its own,
not the wire datum (`_layout` builds that), so a schema change cannot change what plug-ins see.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from rollstream.schemas._errors import InvalidRecordError
from rollstream.schemas._packing import int32_array
from rollstream.schemas._samples import FINISH_REASONS, Sample, Samples, VersionSpan
from rollstream.schemas.inflight import InflightCheckpoint

__all__ = ["DISPOSITION_KINDS", "FINISH_REASONS", "GREEDY_BELOW", "PLUGIN_KEYS", "ChatMessage", "OffsetDisposition",
           "PartitionRange", "PolicyVersion", "Prompt", "Record", "Sample", "Samples", "Sampling", "ScoredGroup",
           "StepManifest", "TrainerPosition", "VersionSpan", "chat_dicts", "logprob_temperature", "make_group_id",
           "now_ms", "string_metadata"]

GroupStatus = Literal["ok", "failed"]
DispositionKind = Literal["taken", "filtered", "duplicate", "undecodable", "requeued"]
DISPOSITION_KINDS: tuple[DispositionKind, ...] = ("taken", "filtered", "duplicate", "undecodable", "requeued")


def now_ms() -> int:
    """Wall-clock time in integer milliseconds since the epoch (the unit of every `*_ms` field)."""
    return time.time_ns() // 1_000_000


def make_group_id(prompt_id: str, epoch: int) -> str:
    """The deterministic id of the group for `prompt_id` in `epoch`: a re-generated group gets the same id."""
    return f"{prompt_id}#{epoch}"


def string_metadata(metadata: Mapping[str, Any] | None) -> dict[str, str]:
    """Metadata as Avro `map<string>`: strings kept, any other JSON value JSON-encoded."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidRecordError(f"metadata must be a mapping, got {type(metadata).__name__}")
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """One prompt for one epoch. `prompt` is plain text or a tuple of chat messages.

    `attempt` is 0 as loaded and k when the trainer requeued the prompt for the k-th time (its group
    went stale or failed for a passing reason); every attempt answers with the same group id.
    """

    id: str
    prompt: str | tuple[ChatMessage, ...]
    epoch: int = 0
    label: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRecordError(f"prompt id must be a non-empty string, got {self.id!r}")
        if not isinstance(self.attempt, int) or self.attempt < 0:
            raise InvalidRecordError(f"prompt {self.id!r}: attempt must be an integer >= 0, got {self.attempt!r}")
        if isinstance(self.prompt, list | tuple):
            messages = tuple(_chat_message(m) for m in self.prompt)
            object.__setattr__(self, "prompt", messages)
        elif not isinstance(self.prompt, str):
            raise InvalidRecordError(f"prompt {self.id!r}: 'prompt' must be a string or a list of chat messages")
        if self.label is not None and not isinstance(self.label, str):
            object.__setattr__(self, "label", json.dumps(self.label))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))

    @property
    def group_id(self) -> str:
        return make_group_id(self.id, self.epoch)

    def plugin_dict(self) -> dict[str, Any]:
        """The prompt dict plug-in generate and reward functions receive (the public contract, docs/engines.md
        "Custom generate"): exactly the keys `PLUGIN_KEYS`, ``id``, ``prompt`` (text,
        or a list of ``{"role", "content"}`` dicts), ``label`` (None when absent), ``metadata`` (a fresh
        dict of strings), ``epoch`` and ``attempt`` (0, or k for the k-th requeue). Not the wire datum:
        a schema change leaves it as it is. A fresh dict each call: a plug-in may change its copy."""
        return {"id": self.id, "prompt": self.prompt if isinstance(self.prompt, str) else chat_dicts(self.prompt),
                "label": self.label, "metadata": dict(self.metadata), "epoch": self.epoch, "attempt": self.attempt}

    def to_dict(self) -> dict[str, Any]:
        """`plugin_dict`, by its former name (kept for callers written against it)."""
        return self.plugin_dict()


PLUGIN_KEYS: tuple[str, ...] = ("id", "prompt", "label", "metadata", "epoch", "attempt")
"""The keys of `Prompt.plugin_dict`, the prompt dict of the plug-in contract."""


def chat_dicts(messages: tuple[ChatMessage, ...]) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` dicts (a fresh list)."""
    return [{"role": m.role, "content": m.content} for m in messages]


def _chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
        return ChatMessage(role=m["role"], content=m["content"])
    raise InvalidRecordError(f"a chat message needs string 'role' and 'content', got {m!r}")


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters that shaped a group's logprobs (top_k -1: off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and (self.top_k == -1 or self.top_k >= 1)):
            raise InvalidRecordError(f"sampling temperature={self.temperature} top_p={self.top_p} top_k={self.top_k}: "
                                     "need temperature >= 0, 0 < top_p <= 1, top_k -1 (off) or >= 1")

    @property
    def logprob_temperature(self) -> float:
        """The temperature the logprobs were computed at (see `logprob_temperature`)."""
        return logprob_temperature(self.temperature)


GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: a temperature below it is greedy decoding


def logprob_temperature(temperature: float) -> float:
    """The temperature logprobs are computed at for a sampling `temperature`: itself, or 1.0 for greedy
    decoding (below `GREEDY_BELOW`; SGLang then takes ``log_softmax(logits)``). Engines compute
    ``log_softmax(logits / T)`` at it and the trainer divides its logits by the same."""
    return 1.0 if temperature < GREEDY_BELOW else temperature


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """All samples for one prompt in one epoch, scored. `status == "failed"` carries `error`.

    `samples` is given as any sequence of `Sample` and kept as `Samples` (a read-only sequence).
    `attempt` is the prompt's attempt it answers (0 first), `max_attempts` the producer's limit, and
    `retriable` whether a failure may pass (engine timeout, server restart); `source_prompt` is the
    Prompt record it came from, as read (what the trainer republishes when it requeues the prompt).
    `policy_run` is the trainer run whose versions the producer followed when the generation started
    (`PolicyVersion.run`; 0: none known): the samples' weight versions are that run's.
    Not hashable (holds arrays).
    """

    group_id: str
    prompt_id: str
    epoch: int
    prompt_tokens: np.ndarray
    samples: Samples
    started_at_ms: int
    finished_at_ms: int
    prompt: str = ""
    producer_id: str = ""
    status: GroupStatus = "ok"
    error: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    sampling: Sampling | None = None  # None: not recorded (records written before schema v4)
    attempt: int = 0
    max_attempts: int = 1
    retriable: bool = False
    source_prompt: bytes = b""
    policy_run: int = 0

    def __post_init__(self) -> None:
        if self.attempt < 0 or self.max_attempts < 1 or self.policy_run < 0:
            raise InvalidRecordError(f"group {self.group_id!r}: attempt {self.attempt} and policy_run "
                                     f"{self.policy_run} must be >= 0 and max_attempts {self.max_attempts} >= 1")
        object.__setattr__(self, "prompt_tokens", int32_array(self.prompt_tokens, "prompt_tokens"))
        object.__setattr__(self, "samples", Samples.of(self.samples))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))
        if self.status not in ("ok", "failed"):
            raise InvalidRecordError(f"group status {self.status!r} is not 'ok' or 'failed'")
        if self.status == "failed" and not self.error:
            raise InvalidRecordError(f"failed group {self.group_id!r} needs an error message")

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        if not isinstance(other, ScoredGroup) or type(other) is not type(self):
            return False
        return (self._scalars() == other._scalars() and self.prompt_tokens.tobytes() == other.prompt_tokens.tobytes()
                and self.samples == other.samples)

    def _scalars(self) -> tuple[Any, ...]:
        return (self.group_id, self.prompt_id, self.epoch, self.prompt, self.producer_id, self.status, self.error,
                self.started_at_ms, self.finished_at_ms, dict(self.metadata), self.sampling, self.attempt,
                self.max_attempts, self.retriable, self.source_prompt, self.policy_run)

    @property
    def rewards(self) -> list[float | None]:
        return self.samples.rewards

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest policy version among the samples (what staleness is measured by), or None."""
        return self.samples.oldest_weight_version

    @property
    def nbytes(self) -> int:
        """Bytes of packed token and logprob payload (a cheap size estimate)."""
        return self.prompt_tokens.nbytes + self.samples.nbytes


@dataclass(frozen=True)
class PartitionRange:
    """Offsets [start, end) of one partition (end exclusive: the next offset to consume)."""

    partition: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise InvalidRecordError(f"bad range [{self.start}, {self.end}) for partition {self.partition}")


@dataclass(frozen=True)
class OffsetDisposition:
    """What a step did with one offset: taken, filtered (reason), duplicate, undecodable (error), or
    requeued (filtered for a passing reason, its prompt published again); `attempt` is its group's."""

    partition: int
    offset: int
    kind: DispositionKind
    group_id: str | None = None
    reason: str | None = None
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DISPOSITION_KINDS:
            raise InvalidRecordError(f"disposition {self.kind!r} is not one of {DISPOSITION_KINDS}")
        if self.attempt < 0:
            raise InvalidRecordError(f"disposition of offset {self.offset}: attempt {self.attempt} must be >= 0")

    @classmethod
    def _checked(cls, partition: int, offset: int, kind: DispositionKind, group_id: str | None, reason: str | None,
                 attempt: int) -> OffsetDisposition:
        """A row of manifest columns `_layout` checked with the rules above (kind codes in range, no attempt
        below 0), for a whole manifest at once: a manifest holds one disposition per offset of a step, and
        the constructor would add ~0.45 us per row (+55% to decoding a manifest of 1,000 offsets)."""
        disposition = cls.__new__(cls)
        disposition.__dict__.update({"partition": partition, "offset": offset, "kind": kind, "group_id": group_id,
                                     "reason": reason, "attempt": attempt})
        return disposition


@dataclass(frozen=True)
class StepManifest:
    """What one trainer step covered on the rollouts topic and the disposition of every offset in it."""

    step: int
    consumer_group: str
    topic: str
    ranges: tuple[PartitionRange, ...]
    dispositions: tuple[OffsetDisposition, ...]
    created_at_ms: int = field(default_factory=now_ms)
    policy_version: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", tuple(self.ranges))
        object.__setattr__(self, "dispositions", tuple(self.dispositions))


@dataclass(frozen=True)
class PolicyVersion:
    """A policy version announced by the trainer on the control topic.

    `run` and `run_id` say which trainer run announced it; `PolicyAnnouncer` sets them (leave them out).
    Runs are numbered 1, 2, ... in the order they began; run 0 is a record written before runs existed.
    Producers follow the newest run's versions, also lower ones than an older run's (see
    `rollstream.infra.control`).
    """

    version: int
    weights_path: str | None = None
    created_at_ms: int = field(default_factory=now_ms)
    metadata: Mapping[str, str] = field(default_factory=dict)
    run: int = 0
    run_id: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", string_metadata(self.metadata))
        if self.run < 0:
            raise InvalidRecordError(f"PolicyVersion.run must be >= 0, got {self.run}")

    def label(self) -> str:
        """``version 51 of run 4`` (or ``version 51`` for run 0), for logs and errors."""
        return f"version {self.version}" + (f" of run {self.run}" if self.run else "")


@dataclass(frozen=True)
class TrainerPosition:
    """A trainer group's position on the rollouts topic right after it committed a step (on NS.control).

    `committed` and `ends` map partition -> offset: the committed offset, and the end offset the trainer
    last saw (at `observed_at_ms`; records produced after that are not counted in `lag`).
    """

    consumer_group: str
    topic: str
    step: int
    committed: Mapping[int, int]
    ends: Mapping[int, int]
    observed_at_ms: int
    created_at_ms: int = field(default_factory=now_ms)

    def __post_init__(self) -> None:
        object.__setattr__(self, "committed", {int(p): int(o) for p, o in self.committed.items()})
        object.__setattr__(self, "ends", {int(p): int(o) for p, o in self.ends.items()})
        if set(self.committed) != set(self.ends):
            raise InvalidRecordError(f"trainer position: committed offsets of partitions {sorted(self.committed)} but "
                                     f"end offsets of {sorted(self.ends)}; give both for the same partitions")

    @property
    def lag(self) -> int:
        """Records after the committed offsets, up to the end offsets seen."""
        return sum(max(0, self.ends[p] - c) for p, c in self.committed.items())


Record = Prompt | ScoredGroup | StepManifest | PolicyVersion | TrainerPosition | InflightCheckpoint
