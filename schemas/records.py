"""The records rollstream puts on Kafka, as frozen dataclasses: the domain, not the wire.

Token ids and logprobs are numpy arrays (int32 / float32); lists are accepted on construction and
converted. Constructors validate (InvalidRecordError names the field). How each record is laid out on
the wire is `_layout`'s business, and older layouts are `_upgrade`'s; nothing here knows either. The
one link is `SampleColumns`: what decoded samples offer before any `Sample` object is built.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, overload

import numpy as np

from schemas._errors import InvalidRecordError
from schemas._packing import INT32_LE, float32_array, int32_array

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")  # the one definition: engines and _layout import it
GroupStatus = Literal["ok", "failed"]
DispositionKind = Literal["taken", "filtered", "duplicate", "undecodable"]
DISPOSITION_KINDS: tuple[DispositionKind, ...] = ("taken", "filtered", "duplicate", "undecodable")


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
            raise InvalidRecordError(f"prompt {self.id!r}: 'prompt' must be a string or a list of chat messages")
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


def _chat_message(m: Any) -> ChatMessage:
    if isinstance(m, ChatMessage):
        return m
    if isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str):
        return ChatMessage(role=m["role"], content=m["content"])
    raise InvalidRecordError(f"a chat message needs string 'role' and 'content', got {m!r}")


@dataclass(frozen=True, eq=False)
class Sample:
    """One generated response: token ids (int32), optional per-token logprobs (float32), reward
    (None when unscored; a NaN reward is taken as None). Not hashable (holds arrays)."""

    tokens: np.ndarray
    text: str = ""
    logprobs: np.ndarray | None = None
    reward: float | None = None
    finish_reason: str = "stop"
    weight_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", int32_array(self.tokens, "tokens"))
        object.__setattr__(self, "logprobs", float32_array(self.logprobs, "logprobs"))
        if self.logprobs is not None and len(self.logprobs) != len(self.tokens):
            raise InvalidRecordError(f"sample has {len(self.tokens)} tokens but {len(self.logprobs)} logprobs; "
                                     "give one logprob per response token, or none")
        if self.logprobs is not None and not np.isfinite(self.logprobs).all():
            bad = int((~np.isfinite(self.logprobs)).sum())
            raise InvalidRecordError(f"{bad} of {len(self.logprobs)} logprobs are NaN or infinite; give finite ones")
        if self.finish_reason not in FINISH_REASONS:
            raise InvalidRecordError(f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
        if self.reward is not None:  # NaN is no score (the wire stores a missing reward as NaN); inf is no number
            reward = float(self.reward)
            if math.isinf(reward):
                raise InvalidRecordError(f"reward {reward} is not a finite number")
            object.__setattr__(self, "reward", None if math.isnan(reward) else reward)
        object.__setattr__(self, "weight_versions", tuple(int(v) for v in self.weight_versions))

    @classmethod
    def _decoded(cls, tokens: np.ndarray, text: str, logprobs: np.ndarray | None, reward: float | None,
                 finish_reason: str, weight_versions: tuple[int, ...]) -> Sample:
        """A sample from decoded columns, without `__post_init__`: decoding is the trainer's hot path, the
        schema already typed every field and `_layout` checked what Avro cannot (sizes, codes)."""
        sample = cls.__new__(cls)
        sample.__dict__.update({"tokens": tokens, "text": text, "logprobs": logprobs, "reward": reward,
                                "finish_reason": finish_reason, "weight_versions": weight_versions})
        return sample

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        if not isinstance(other, Sample) or type(other) is not type(self):
            return False
        return (self.tokens.tobytes() == other.tokens.tobytes()
                and (None if self.logprobs is None else self.logprobs.tobytes())
                == (None if other.logprobs is None else other.logprobs.tobytes())
                and (self.text, self.reward, self.finish_reason, self.weight_versions)
                == (other.text, other.reward, other.finish_reason, other.weight_versions))

    @property
    def weight_version(self) -> int | None:
        """The oldest policy version that contributed to this sample (what staleness is measured by)."""
        return min(self.weight_versions) if self.weight_versions else None


class SampleColumns(Protocol):
    """A group's samples held column by column (`_layout.SampleColumns`): what `Samples` answers without
    building a `Sample`. `versions` are every sample's policy versions back to back, `tokens` every
    response token back to back (a view of the record's bytes when decoded), `samples()` one `Sample`
    per row, its arrays views of the columns."""

    lengths: Sequence[int]
    rewards: list[float | None]
    versions: Sequence[int]

    def __len__(self) -> int: ...
    @property
    def tokens(self) -> np.ndarray: ...
    @property
    def nbytes(self) -> int: ...
    def samples(self) -> tuple[Sample, ...]: ...


class Samples(Sequence[Sample]):
    """The samples of one group: a read-only sequence of `Sample`.

    Built from `Sample` objects (a producer) or from decoded columns (a consumer). From columns, no
    `Sample` is built until one is asked for, so a trainer that only looks at rewards never builds one,
    and `tokens` of every sample are views into one array (`response_tokens`), not copies. Compares
    equal to any sequence of equal samples (a tuple, a list). Not hashable.
    """

    __slots__ = ("_source", "_built")

    def __init__(self, items: Iterable[Sample] = ()) -> None:
        samples = tuple(items)
        for s in samples:
            if not isinstance(s, Sample):
                raise InvalidRecordError(f"samples must be Sample objects, got {type(s).__name__}")
        self._source: tuple[Sample, ...] | SampleColumns = samples
        self._built: tuple[Sample, ...] | None = None  # the Sample objects, once `_source` is columns

    @classmethod
    def of(cls, samples: Iterable[Sample]) -> Samples:
        return samples if isinstance(samples, Samples) else cls(samples)

    @classmethod
    def _of_columns(cls, columns: SampleColumns) -> Samples:
        """Samples that view decoded columns (the columns were checked on decode)."""
        obj = cls.__new__(cls)
        obj._source, obj._built = columns, None
        return obj

    @property
    def columns(self) -> SampleColumns | None:
        """The columns these samples hold: decoded ones, or those their first encode built; else None."""
        return None if isinstance(self._source, tuple) else self._source

    def _hold_columns(self, columns: SampleColumns) -> None:
        """Keep `columns`, built from these samples by an encode, so the next encode (a retry) does not
        build them again; the `Sample` objects stay. `_built` is set first: a concurrent reader sees
        either form whole."""
        if isinstance(self._source, tuple):
            self._built = self._source
            self._source = columns

    def __len__(self) -> int:
        return len(self._source)

    @overload
    def __getitem__(self, index: int) -> Sample: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Sample, ...]: ...

    def __getitem__(self, index: int | slice) -> Sample | tuple[Sample, ...]:
        return self.items()[index]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __repr__(self) -> str:
        return f"Samples({list(self.items())!r})"

    def items(self) -> tuple[Sample, ...]:
        """The samples as `Sample` objects (built from the columns on first call, then kept)."""
        source = self._source
        if isinstance(source, tuple):
            return source
        if self._built is None:
            self._built = source.samples()
        return self._built

    @property
    def rewards(self) -> list[float | None]:
        """The reward of each sample (None where unscored), without building `Sample` objects."""
        source = self._source
        return [s.reward for s in source] if isinstance(source, tuple) else list(source.rewards)

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest policy version that contributed to any sample (None when none carries one)."""
        source = self._source
        if isinstance(source, tuple):
            return min((v for s in source for v in s.weight_versions), default=None)
        return min(source.versions, default=None)

    @property
    def response_tokens(self) -> np.ndarray:
        """Every sample's response tokens, back to back (split them with `response_lengths`)."""
        source = self._source
        if not isinstance(source, tuple):
            return source.tokens
        return np.concatenate([s.tokens for s in source]) if source else np.empty(0, INT32_LE)

    @property
    def response_lengths(self) -> list[int]:
        """The number of response tokens of each sample."""
        source = self._source
        return [len(s.tokens) for s in source] if isinstance(source, tuple) else list(source.lengths)

    @property
    def nbytes(self) -> int:
        """Bytes of packed token and logprob payload."""
        source = self._source
        if not isinstance(source, tuple):
            return source.nbytes
        return sum(s.tokens.nbytes + (0 if s.logprobs is None else s.logprobs.nbytes) for s in source)


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """All samples for one prompt in one epoch, scored. `status == "failed"` carries `error`.

    `samples` is given as any sequence of `Sample` and kept as `Samples` (a read-only sequence).
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", int32_array(self.prompt_tokens, "prompt_tokens"))
        object.__setattr__(self, "samples", Samples.of(self.samples))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))
        if self.status not in ("ok", "failed"):
            raise InvalidRecordError(f"group status {self.status!r} is not 'ok' or 'failed'")
        if self.status == "failed" and not self.error:
            raise InvalidRecordError(f"failed group {self.group_id!r} needs an error message")

    @classmethod
    def _decoded(cls, *, group_id: str, prompt_id: str, epoch: int, prompt_tokens: np.ndarray, samples: Samples,
                 started_at_ms: int, finished_at_ms: int, prompt: str, producer_id: str, status: GroupStatus,
                 error: str | None, metadata: dict[str, str]) -> ScoredGroup:
        """A group from a decoded record, without `__post_init__`: the schema already typed every field,
        `_layout` checked the rest, and decoding is the trainer's hot path."""
        group = cls.__new__(cls)
        group.__dict__.update({"group_id": group_id, "prompt_id": prompt_id, "epoch": epoch,
                               "prompt_tokens": prompt_tokens, "samples": samples, "started_at_ms": started_at_ms,
                               "finished_at_ms": finished_at_ms, "prompt": prompt, "producer_id": producer_id,
                               "status": status, "error": error, "metadata": metadata})
        return group

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        if not isinstance(other, ScoredGroup) or type(other) is not type(self):
            return False
        return (self._scalars() == other._scalars() and self.prompt_tokens.tobytes() == other.prompt_tokens.tobytes()
                and self.samples == other.samples)

    def _scalars(self) -> tuple[Any, ...]:
        return (self.group_id, self.prompt_id, self.epoch, self.prompt, self.producer_id, self.status, self.error,
                self.started_at_ms, self.finished_at_ms, dict(self.metadata))

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
    """What a step did with one offset: taken, filtered (reason), duplicate, undecodable (error)."""

    partition: int
    offset: int
    kind: DispositionKind
    group_id: str | None = None
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in DISPOSITION_KINDS:
            raise InvalidRecordError(f"disposition {self.kind!r} is not one of {DISPOSITION_KINDS}")

    @classmethod
    def _decoded(cls, partition: int, offset: int, kind: DispositionKind, group_id: str | None,
                 reason: str | None) -> OffsetDisposition:
        """A disposition from decoded manifest columns, without `__post_init__`: a manifest holds one per
        offset of a step, and `_layout` already checked the kind code."""
        disposition = cls.__new__(cls)
        disposition.__dict__.update({"partition": partition, "offset": offset, "kind": kind, "group_id": group_id,
                                     "reason": reason})
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
    """A policy version announced by the trainer on the control topic."""

    version: int
    weights_path: str | None = None
    created_at_ms: int = field(default_factory=now_ms)
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metadata", string_metadata(self.metadata))


Record = Prompt | ScoredGroup | StepManifest | PolicyVersion
