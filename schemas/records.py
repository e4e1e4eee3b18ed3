"""The records rollstream puts on Kafka, as frozen dataclasses.

Each record converts to and from the plain dict the codec writes (`to_avro` / `from_avro`); a
ScoredGroup gives its packed token columns as contiguous numpy arrays (or a tuple of them, one per
sample), which the codec writes without joining them first. Token ids
and logprobs are numpy arrays (int32 / float32); lists are accepted on construction and converted.
The `.avsc` files beside this module are the wire contract; these classes mirror them field by field.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from schemas._errors import DecodeError, InvalidRecordError
from schemas._packing import FLOAT32_LE, INT32_LE, pack, pack_values, unpack, unpack_values

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
    if isinstance(values, np.ndarray) and values.dtype == INT32_LE and values.ndim == 1 and values.flags.c_contiguous:
        return values
    return unpack(pack(values, INT32_LE, name), INT32_LE, name)


def _float_array(values: Any, name: str) -> np.ndarray | None:
    if values is None:
        return None
    if isinstance(values, np.ndarray) and values.dtype == FLOAT32_LE and values.ndim == 1 and values.flags.c_contiguous:
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
    """One generated response: token ids (int32), optional per-token logprobs (float32), reward
    (None when unscored; a NaN reward is taken as None)."""

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
        if self.reward is not None:  # NaN is no score: the wire stores a missing reward as NaN
            reward = float(self.reward)
            object.__setattr__(self, "reward", None if math.isnan(reward) else reward)
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
        """Build from a decoded row-layout (schema v1/v2) sample datum. Trusted path: the schema already
        typed every field, so only what Avro cannot check (array sizes, the finish-reason set) is validated."""
        tokens = np.frombuffer(d["tokens"], INT32_LE)  # ValueError on a ragged size: a DecodeError upstream
        logprobs = d["logprobs"]
        if logprobs is not None:
            logprobs = np.frombuffer(logprobs, FLOAT32_LE)
            if logprobs.shape != tokens.shape:
                raise DecodeError(f"sample has {len(tokens)} tokens but {len(logprobs)} logprobs")
        if d["finish_reason"] not in FINISH_REASONS:
            raise DecodeError(f"unknown finish_reason {d['finish_reason']!r}")
        return _trusted(cls, tokens=tokens, text=d["text"], logprobs=logprobs, reward=d["reward"],
                        finish_reason=d["finish_reason"], weight_versions=tuple(d["weight_versions"]))


class Samples(Sequence[Sample]):
    """The samples of one group: a read-only sequence of `Sample`, held as the columns the wire carries.

    Built from `Sample` objects (a producer) or from decoded columns (a consumer); each form is made
    from the other on first use. So a trainer that only looks at rewards never builds a `Sample`, and
    `tokens` of every sample are views into one array (`response_tokens`), not copies. Compares equal
    to any sequence of equal samples (a tuple, a list).
    """

    __slots__ = ("_items", "_columns")

    def __init__(self, items: Iterable[Sample] = ()) -> None:
        self._items: tuple[Sample, ...] | None = tuple(items)
        for s in self._items:
            if not isinstance(s, Sample):
                raise InvalidRecordError(f"samples must be Sample objects, got {type(s).__name__}")
        self._columns: _Columns | None = None

    @classmethod
    def of(cls, samples: Iterable[Sample]) -> Samples:
        return samples if isinstance(samples, Samples) else cls(samples)

    @classmethod
    def _from_columns(cls, columns: _Columns) -> Samples:
        obj = cls.__new__(cls)
        obj._items, obj._columns = None, columns
        return obj

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self._columns.lengths)  # type: ignore[union-attr]

    def __getitem__(self, index):  # type: ignore[no-untyped-def]  # int -> Sample, slice -> tuple
        return self.items()[index]

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.items())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Samples({list(self.items())!r})"

    def items(self) -> tuple[Sample, ...]:
        """The samples as `Sample` objects (built from the columns on first call, then kept)."""
        if self._items is None:
            self._items = self._columns.split()  # type: ignore[union-attr]
        return self._items

    @property
    def rewards(self) -> list[float | None]:
        """The reward of each sample (None where unscored), without building `Sample` objects."""
        if self._items is not None:
            return [s.reward for s in self._items]
        return list(self._columns.rewards)  # type: ignore[union-attr]

    @property
    def oldest_weight_version(self) -> int | None:
        """The oldest policy version that contributed to any sample (None when none carries one)."""
        if self._items is not None:
            return min((v for s in self._items for v in s.weight_versions), default=None)
        return min(self._columns.versions, default=None)  # type: ignore[union-attr]

    @property
    def response_tokens(self) -> np.ndarray:
        """Every sample's response tokens, back to back (split them with `response_lengths`)."""
        return self._as_columns().tokens

    @property
    def response_lengths(self) -> list[int]:
        """The number of response tokens of each sample."""
        return list(self._as_columns().lengths)

    def _as_columns(self) -> _Columns:
        if self._columns is None:
            self._columns = _Columns.of(self._items or ())
        return self._columns


@dataclass(slots=True, eq=False)
class _Columns:
    """A group's samples column by column, as schema v3 stores them (see scored_group.avsc).

    Tokens and logprobs are held in parts: one per sample when built from `Sample` objects (encoding
    writes them back to back without joining them first), one view of the record when decoded.
    """

    lengths: Sequence[int]
    rewards: list[float | None]
    finish_codes: bytes
    has_logprobs: bytes
    version_counts: Sequence[int]
    versions: Sequence[int]
    text_lengths: Sequence[int]
    text: str
    token_parts: tuple[np.ndarray, ...]
    logprob_parts: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> _Columns:
        text, text_lengths = _strings_joined([s.text for s in samples])
        return cls(lengths=[len(s.tokens) for s in samples], rewards=[s.reward for s in samples],
                   finish_codes=bytes(FINISH_REASONS.index(s.finish_reason) for s in samples),
                   has_logprobs=bytes(s.logprobs is not None for s in samples),
                   version_counts=[len(s.weight_versions) for s in samples],
                   versions=[v for s in samples for v in s.weight_versions],
                   text_lengths=text_lengths, text=text,
                   token_parts=tuple(s.tokens for s in samples),
                   logprob_parts=tuple(s.logprobs for s in samples if s.logprobs is not None))

    @property
    def tokens(self) -> np.ndarray:
        return _joined(self.token_parts, INT32_LE)

    @property
    def logprobs(self) -> np.ndarray:
        return _joined(self.logprob_parts, FLOAT32_LE)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.token_parts) + sum(p.nbytes for p in self.logprob_parts)

    @classmethod
    def decoded(cls, d: Mapping[str, Any]) -> _Columns:
        """Columns of a decoded v3 datum; tokens and logprobs become views of the record's bytes (no copy).

        Raises DecodeError when the columns disagree (counts, lengths, codes), which Avro cannot check.
        """
        lengths = unpack_values(d["response_lengths"], "i", "response_lengths")
        rewards = unpack_values(d["rewards"], "d", "rewards")
        counts = unpack_values(d["weight_version_counts"], "i", "weight_version_counts")
        versions = unpack_values(d["weight_versions"], "q", "weight_versions")
        text_lengths = unpack_values(d["text_lengths"], "i", "text_lengths")
        finish, has_logprobs, text = d["finish_reasons"], d["has_logprobs"], d["texts"]
        n = len(lengths)
        if not len(rewards) == len(finish) == len(has_logprobs) == len(counts) == len(text_lengths) == n:
            raise DecodeError(f"columns disagree on the number of samples: {n} lengths, {len(rewards)} rewards, "
                              f"{len(finish)} finish reasons, {len(has_logprobs)} logprob flags, "
                              f"{len(counts)} weight version counts, {len(text_lengths)} text lengths")
        tokens = unpack(d["tokens"], INT32_LE, "tokens")
        logprobs = unpack(d["logprobs"], FLOAT32_LE, "logprobs")
        if n and (min(lengths) < 0 or min(counts) < 0 or min(text_lengths) < 0
                  or max(finish) >= len(FINISH_REASONS) or max(has_logprobs) > 1):
            raise DecodeError(f"bad sample columns: lengths {lengths}, weight version counts {counts}, "
                              f"text lengths {text_lengths}, finish codes {list(finish)}, "
                              f"logprob flags {list(has_logprobs)}")
        if sum(lengths) != len(tokens) or sum(counts) != len(versions) or sum(text_lengths) != len(text):
            raise DecodeError(f"{len(tokens)} response tokens, {len(versions)} weight versions and {len(text)} "
                              f"text characters do not match the samples' lengths {lengths}, counts {counts} "
                              f"and text lengths {text_lengths}")
        if sum(length for length, has in zip(lengths, has_logprobs, strict=True) if has) != len(logprobs):
            raise DecodeError(f"{len(logprobs)} logprobs do not match the samples that have them")
        return cls(lengths=lengths, rewards=[None if r != r else r for r in rewards], finish_codes=finish,
                   has_logprobs=has_logprobs, version_counts=counts, versions=versions,
                   text_lengths=text_lengths, text=text, token_parts=(tokens,), logprob_parts=(logprobs,))

    def to_avro(self) -> dict[str, Any]:
        return {
            "response_lengths": pack_values(self.lengths, "i"),
            "rewards": pack_values([math.nan if r is None else r for r in self.rewards], "d"),
            "finish_reasons": self.finish_codes,
            "has_logprobs": self.has_logprobs,
            "weight_version_counts": pack_values(self.version_counts, "i"),
            "weight_versions": pack_values(self.versions, "q"),
            "text_lengths": pack_values(self.text_lengths, "i"),
            "texts": self.text,
            "tokens": self.token_parts,  # contiguous arrays: the codec writes their bytes back to back
            "logprobs": self.logprob_parts,
        }

    def split(self) -> tuple[Sample, ...]:
        """One `Sample` per row; its arrays are views of the columns."""
        tokens, all_logprobs = self.tokens, self.logprobs
        texts = _strings_split(self.text, self.text_lengths)
        out = []
        token_at = logprob_at = version_at = 0
        for i, n in enumerate(self.lengths):
            logprobs = None
            if self.has_logprobs[i]:
                logprobs = all_logprobs[logprob_at:logprob_at + n]
                logprob_at += n
            count = self.version_counts[i]
            out.append(_trusted(Sample, tokens=tokens[token_at:token_at + n],
                                text=texts[i], logprobs=logprobs, reward=self.rewards[i],
                                finish_reason=FINISH_REASONS[self.finish_codes[i]],
                                weight_versions=tuple(self.versions[version_at:version_at + count])))
            token_at, version_at = token_at + n, version_at + count
        return tuple(out)


def _strings_joined(values: Sequence[str | None]) -> tuple[str, list[int]]:
    """Strings stored back to back: the text and each one's length in code points (-1 for None)."""
    return "".join(v for v in values if v is not None), [-1 if v is None else len(v) for v in values]


def _strings_split(text: str, lengths: Sequence[int]) -> list[str | None]:
    """The inverse of `_strings_joined` (the lengths were checked against the text on decode)."""
    out: list[str | None] = []
    at = 0
    for length in lengths:
        if length < 0:
            out.append(None)
        else:
            out.append(text[at:at + length])
            at += length
    return out


def _joined(parts: tuple[np.ndarray, ...], dtype: np.dtype) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype)


@dataclass(frozen=True, eq=False)
class ScoredGroup:
    """All samples for one prompt in one epoch, scored. `status == "failed"` carries `error`.

    `samples` is given as any sequence of `Sample` and kept as `Samples` (a read-only sequence).
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
        object.__setattr__(self, "prompt_tokens", _int_array(self.prompt_tokens, "prompt_tokens"))
        object.__setattr__(self, "samples", Samples.of(self.samples))
        object.__setattr__(self, "metadata", string_metadata(self.metadata))
        if self.status not in ("ok", "failed"):
            raise InvalidRecordError(f"group status {self.status!r} is not 'ok' or 'failed'")
        if self.status == "failed" and not self.error:
            raise InvalidRecordError(f"failed group {self.group_id!r} needs an error message")

    def __eq__(self, other: object) -> bool:
        """Equal when every field is, arrays compared by their packed bytes."""
        if type(other) is not type(self):
            return False
        return _joined_parts(self.to_avro()) == _joined_parts(other.to_avro())  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # holds arrays: not hashable

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
        return self.prompt_tokens.nbytes + self.samples._as_columns().nbytes

    def to_avro(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "epoch": self.epoch,
            "status": self.status.upper(),
            "error": self.error,
            "producer_id": self.producer_id,
            "started_at_ms": self.started_at_ms,
            "finished_at_ms": self.finished_at_ms,
            "prompt": self.prompt,
            "metadata": dict(self.metadata),
            **self.samples._as_columns().to_avro(),
            "prompt_tokens": self.prompt_tokens,  # a contiguous array: the codec writes its bytes
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> ScoredGroup:
        """Build from a decoded datum: schema v3 (columns) or the row layout of v1/v2 (``samples``).

        Trusted path: the schema already typed every field; what Avro cannot check (sizes, lengths
        that must agree) raises DecodeError.
        """
        if d["status"] == "FAILED" and not d["error"]:
            raise DecodeError(f"failed group {d['group_id']!r} carries no error")
        if "samples" in d:
            samples = Samples(Sample.from_avro(s) for s in d["samples"])
        else:
            samples = Samples._from_columns(_Columns.decoded(d))
        return _trusted(
            cls,
            group_id=d["group_id"],
            prompt_id=d["prompt_id"],
            epoch=d["epoch"],
            prompt=d["prompt"],
            prompt_tokens=unpack(d["prompt_tokens"], INT32_LE, "prompt_tokens"),
            samples=samples,
            producer_id=d["producer_id"],
            started_at_ms=d["started_at_ms"],
            finished_at_ms=d["finished_at_ms"],
            status=d["status"].lower(),
            error=d["error"],
            metadata=d["metadata"],
        )


def _joined_parts(datum: dict[str, Any]) -> dict[str, Any]:
    """`datum` with every packed field (an array, or a tuple of arrays) as plain bytes."""
    return {k: b"".join(v) if isinstance(v, tuple) else v.tobytes() if isinstance(v, np.ndarray) else v
            for k, v in datum.items()}


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
        dispositions = self.dispositions
        ids, id_lengths = _strings_joined([d.group_id for d in dispositions])
        return {
            "step": self.step,
            "consumer_group": self.consumer_group,
            "topic": self.topic,
            "created_at_ms": self.created_at_ms,
            "policy_version": self.policy_version,
            "ranges": [vars(r) for r in self.ranges],
            "partitions": pack_values([d.partition for d in dispositions], "i"),
            "offsets": pack_values([d.offset for d in dispositions], "q"),
            "kinds": bytes(_KIND_CODES[d.kind] for d in dispositions),
            "group_id_lengths": pack_values(id_lengths, "i"),
            "group_ids": ids,
            "reasons": [{"index": n, "reason": d.reason} for n, d in enumerate(dispositions) if d.reason is not None],
        }

    @classmethod
    def from_avro(cls, d: Mapping[str, Any]) -> StepManifest:
        """Build from a decoded datum: version 2 (columns) or the one-record-per-offset layout of version 1."""
        if "dispositions" in d:
            dispositions = tuple(OffsetDisposition(**{**x, "kind": x["kind"].lower()}) for x in d["dispositions"])
        else:
            dispositions = _dispositions_from_columns(d)
        return cls(step=d["step"], consumer_group=d["consumer_group"], topic=d["topic"],
                   created_at_ms=d["created_at_ms"], policy_version=d["policy_version"],
                   ranges=tuple(PartitionRange(**r) for r in d["ranges"]), dispositions=dispositions)


_KIND_CODES = {kind: code for code, kind in enumerate(DISPOSITION_KINDS)}


def _dispositions_from_columns(d: Mapping[str, Any]) -> tuple[OffsetDisposition, ...]:
    """The dispositions of a version-2 manifest. Raises DecodeError when its columns disagree."""
    partitions = unpack_values(d["partitions"], "i", "partitions")
    offsets = unpack_values(d["offsets"], "q", "offsets")
    lengths = unpack_values(d["group_id_lengths"], "i", "group_id_lengths")
    kinds, ids = d["kinds"], d["group_ids"]
    n = len(partitions)
    if not len(offsets) == len(kinds) == len(lengths) == n:
        raise DecodeError(f"manifest columns disagree: {n} partitions, {len(offsets)} offsets, {len(kinds)} "
                          f"kinds, {len(lengths)} group id lengths")
    if n and (max(kinds) >= len(DISPOSITION_KINDS) or min(lengths) < -1):
        raise DecodeError(f"manifest has a disposition kind code beyond {len(DISPOSITION_KINDS) - 1} "
                          "or a group id length below -1")
    if sum(length for length in lengths if length > 0) != len(ids):
        raise DecodeError(f"manifest group ids are {len(ids)} characters, their lengths say otherwise")
    reasons: dict[int, str] = {}
    for r in d["reasons"]:
        if not 0 <= r["index"] < n:
            raise DecodeError(f"manifest reason for disposition {r['index']} of {n}")
        reasons[r["index"]] = r["reason"]
    group_ids = _strings_split(ids, lengths)
    return tuple(_trusted(OffsetDisposition, partition=partitions[i], offset=offsets[i],
                          kind=DISPOSITION_KINDS[kinds[i]], group_id=group_ids[i], reason=reasons.get(i))
                 for i in range(n))


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
