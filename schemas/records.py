"""The records rollstream puts on Kafka, as frozen dataclasses.

Each record converts to and from the plain dict fastavro writes (`to_avro` / `from_avro`). Token ids
and logprobs are numpy arrays (int32 / float32); lists are accepted on construction and converted.
The `.avsc` files beside this module are the wire contract; these classes mirror them field by field.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from schemas._errors import DecodeError, InvalidRecordError
from schemas._packing import FLOAT32_LE, INT32_LE, pack, unpack

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
GroupStatus = Literal["ok", "failed"]
DispositionKind = Literal["taken", "filtered", "duplicate", "undecodable"]
DISPOSITION_KINDS: tuple[str, ...] = ("taken", "filtered", "duplicate", "undecodable")
_T = TypeVar("_T")


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


def _int_array(values: Any, name: str) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == INT32_LE and values.ndim == 1:
        return values
    return unpack(pack(values, INT32_LE, name), INT32_LE, name)


def _float_array(values: Any, name: str) -> np.ndarray | None:
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == FLOAT32_LE and values.ndim == 1:
        return values
    return unpack(pack(values, FLOAT32_LE, name), FLOAT32_LE, name)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """One prompt for one epoch. `prompt` is plain text or a tuple of chat messages."""

    id: str
    prompt: str | tuple[ChatMessage, ...]
    epoch: int = 0
    label: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise InvalidRecordError(f"prompt id must be a non-empty string, got {self.id!r}")
        if isinstance(self.prompt, list | tuple):
            messages = tuple(_chat_message(m) for m in self.prompt)
            object.__setattr__(self, "prompt", messages)
        elif not isinstance(self.prompt, str):
            raise InvalidRecordError(
                f"prompt {self.id!r}: 'prompt' must be a string or a list of chat messages"
            )
        if self.label is not None and not isinstance(self.label, str):
            object.__setattr__(self, "label", json.dumps(self.label))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))

    @property
    def group_id(self) -> str:
        return make_group_id(self.id, self.epoch)

    def to_dict(self) -> dict[str, Any]:
        """The dict handed to generate and reward functions: id, prompt, label, metadata, epoch."""
        prompt: Any = self.prompt
        if not isinstance(prompt, str):
            prompt = [{"role": m.role, "content": m.content} for m in prompt]
        return {"id": self.id, "prompt": prompt, "label": self.label,
                "metadata": dict(self.metadata), "epoch": self.epoch}

    def to_avro(self) -> dict[str, Any]:
        return self.to_dict()

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> Prompt:
        return cls(id=d["id"], prompt=d["prompt"], epoch=d["epoch"], label=d["label"],
                   metadata=d["metadata"])


def _chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
        return ChatMessage(role=m["role"], content=m["content"])
    raise InvalidRecordError(f"a chat message needs string 'role' and 'content', got {m!r}")


@dataclass(frozen=True, eq=False)
class Sample:
    """One generated response: token ids (int32), optional per-token logprobs (float32), reward."""

    tokens: np.ndarray
    text: str = ""
    logprobs: np.ndarray | None = None
    reward: float | None = None
    finish_reason: str = "stop"
    weight_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _int_array(self.tokens, "tokens"))
        object.__setattr__(self, "logprobs", _float_array(self.logprobs, "logprobs"))
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise InvalidRecordError(
                f"sample has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs; "
                "give one logprob per response token, or none"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidRecordError(
                f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}"
            )
        if self.reward is not None:
            object.__setattr__(self, "reward", float(self.reward))
        object.__setattr__(self, "weight_versions", tuple(int(v) for v in self.weight_versions))

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        return type(other) is type(self) and self.to_avro() == other.to_avro()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # holds arrays: not hashable

    @property
    def weight_version(self) -> int | None:
        """The oldest policy version that contributed to this sample (what staleness is measured by)."""
        return min(self.weight_versions) if self.weight_versions else None

    def to_avro(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens.tobytes(),
            "logprobs": None if self.logprobs is None else self.logprobs.tobytes(),
            "text": self.text,
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "weight_versions": list(self.weight_versions),
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> Sample:
        """Build from a decoded datum. Trusted, hot path: the schema already typed every field, so
        only what Avro cannot check (array sizes and lengths, the finish-reason set) is validated."""
        tokens = np.frombuffer(d["tokens"], INT32_LE)  # ValueError on a ragged size: a DecodeError upstream
        logprobs = d["logprobs"]
        if logprobs is not None:
            logprobs = np.frombuffer(logprobs, FLOAT32_LE)
            if logprobs.shape != tokens.shape:
                raise DecodeError(f"sample has {len(tokens)} tokens but {len(logprobs)} logprobs")
        if d["finish_reason"] not in FINISH_REASONS:
            raise DecodeError(f"unknown finish_reason {d['finish_reason']!r}")
        obj = cls.__new__(cls)
        obj.__dict__.update(tokens=tokens, text=d["text"], logprobs=logprobs, reward=d["reward"],
                            finish_reason=d["finish_reason"], weight_versions=tuple(d["weight_versions"]))
        return obj


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """All samples for one prompt in one epoch, scored. `status == "failed"` carries `error`."""

    group_id: str
    prompt_id: str
    epoch: int
    prompt_tokens: np.ndarray
    samples: tuple[Sample, ...]
    started_at_ms: int
    finished_at_ms: int
    prompt: str = ""
    producer_id: str = ""
    status: GroupStatus = "ok"
    error: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", _int_array(self.prompt_tokens, "prompt_tokens"))
        object.__setattr__(self, "samples", tuple(self.samples))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))
        if self.status not in ("ok", "failed"):
            raise InvalidRecordError(f"group status {self.status!r} is not 'ok' or 'failed'")
        if self.status == "failed" and not self.error:
            raise InvalidRecordError(f"failed group {self.group_id!r} needs an error message")

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        return type(other) is type(self) and self.to_avro() == other.to_avro()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # holds arrays: not hashable

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def nbytes(self) -> int:
        """Bytes of packed token and logprob payload (a cheap size estimate)."""
        return self.prompt_tokens.nbytes + sum(
            s.tokens.nbytes + (0 if s.logprobs is None else s.logprobs.nbytes) for s in self.samples
        )

    def to_avro(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "epoch": self.epoch,
            "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens.tobytes(),
            "samples": [s.to_avro() for s in self.samples],
            "producer_id": self.producer_id,
            "started_at_ms": self.started_at_ms,
            "finished_at_ms": self.finished_at_ms,
            "status": self.status.upper(),
            "error": self.error,
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> ScoredGroup:
        """Build from a decoded datum (trusted path, see `Sample.from_avro`)."""
        if d["status"] == "FAILED" and not d["error"]:
            raise DecodeError(f"failed group {d['group_id']!r} carries no error")
        return _trusted(
            cls,
            group_id=d["group_id"],
            prompt_id=d["prompt_id"],
            epoch=d["epoch"],
            prompt=d["prompt"],
            prompt_tokens=unpack(d["prompt_tokens"], INT32_LE, "prompt_tokens"),
            samples=tuple(Sample.from_avro(s) for s in d["samples"]),
            producer_id=d["producer_id"],
            started_at_ms=d["started_at_ms"],
            finished_at_ms=d["finished_at_ms"],
            status=d["status"].lower(),
            error=d["error"],
            metadata=d["metadata"],
        )


def _trusted(cls: type[_T], **fields: Any) -> _T:
    """Construct a frozen dataclass without `__post_init__`, for data the Avro schema already typed."""
    obj = cls.__new__(cls)
    obj.__dict__.update(fields)
    return obj


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
    """What a step did with one offset: taken, filtered (reason), duplicate, undecodable (error)."""

    partition: int
    offset: int
    kind: DispositionKind
    group_id: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DISPOSITION_KINDS:
            raise InvalidRecordError(f"disposition {self.kind!r} is not one of {DISPOSITION_KINDS}")


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

    def to_avro(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "consumer_group": self.consumer_group,
            "topic": self.topic,
            "created_at_ms": self.created_at_ms,
            "policy_version": self.policy_version,
            "ranges": [vars(r) for r in self.ranges],
            "dispositions": [{**vars(d), "kind": d.kind.upper()} for d in self.dispositions],
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> StepManifest:
        return cls(
            step=d["step"],
            consumer_group=d["consumer_group"],
            topic=d["topic"],
            created_at_ms=d["created_at_ms"],
            policy_version=d["policy_version"],
            ranges=tuple(PartitionRange(**r) for r in d["ranges"]),
            dispositions=tuple(
                OffsetDisposition(**{**x, "kind": x["kind"].lower()}) for x in d["dispositions"]
            ),
        )


@dataclass(frozen=True)
class PolicyVersion:
    """A policy version announced by the trainer on the control topic."""

    version: int
    weights_path: str | None = None
    created_at_ms: int = field(default_factory=now_ms)
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", string_metadata(self.metadata))

    def to_avro(self) -> dict[str, Any]:
        return {"version": self.version, "weights_path": self.weights_path,
                "created_at_ms": self.created_at_ms, "metadata": dict(self.metadata)}

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> PolicyVersion:
        return cls(**d)


Record = Prompt | ScoredGroup | StepManifest | PolicyVersion
RECORD_TYPES: tuple[type, ...] = (Prompt, ScoredGroup, StepManifest, PolicyVersion)


def tokens_of(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as the int32 array every record holds (validates like a record field)."""
    return _int_array(values, "tokens")
