"""The current wire layout of every record: the datum (plain dict) the codec writes with each schema in
``avro/`` and reads back. Only this module knows it; records know nothing of the wire, and `_upgrade`
turns data of older schemas into this layout, so nothing here knows an older one.

A ScoredGroup (schema v5) stores its samples column by column, a StepManifest (v3) its dispositions:
each column holds one entry per row, packed little-endian (the ``doc`` of each field says how). Strings
of many rows are stored back to back with their lengths (`join_strings`).

Decoding builds no `Sample` until `group.samples` is used: `SampleColumns` keeps the columns, and token
arrays are views of the record's bytes. What Avro cannot check (counts and lengths that must agree,
codes in range) is checked on decode, so building the samples later cannot fail. Pure and thread-safe.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rollstream.schemas._errors import DecodeError
from rollstream.schemas._packing import (
    FLOAT32_LE,
    INT32_LE,
    UINT8,
    float32_array,
    int32_array,
    pack_values,
    unpack,
    unpack_values,
)
from rollstream.schemas.records import (
    DISPOSITION_KINDS,
    FINISH_REASONS,
    OffsetDisposition,
    PartitionRange,
    PolicyVersion,
    Prompt,
    Sample,
    Samples,
    Sampling,
    ScoredGroup,
    StepManifest,
    TrainerPosition,
    VersionSpan,
)

_KIND_CODES = {kind: code for code, kind in enumerate(DISPOSITION_KINDS)}
_FINISH_CODES = {reason: code for code, reason in enumerate(FINISH_REASONS)}
_NO_MASKS = np.frombuffer(b"", UINT8)  # the masks of a record that has none: empty and read-only, so shared


def join_strings(values: Sequence[str | None]) -> tuple[str, list[int]]:
    """Strings stored back to back: the text and each one's length in code points (-1 for None)."""
    return "".join(v for v in values if v is not None), [-1 if v is None else len(v) for v in values]


def split_strings(text: str, lengths: Sequence[int]) -> list[str | None]:
    """The inverse of `join_strings` (the lengths were checked against the text on decode)."""
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


def as_read(datum: Mapping[str, Any]) -> dict[str, Any]:
    """`datum` as the codec reads it back: each packed field given as an array or in parts (a tuple of
    arrays, which encoding writes back to back without joining them) as one `bytes`."""
    return {k: b"".join(v) if isinstance(v, tuple) else v.tobytes() if isinstance(v, np.ndarray) else v
            for k, v in datum.items()}


def unmasked_columns(n: int) -> dict[str, bytes]:
    """The loss-mask and version-span columns of `n` samples that carry neither (what older schemas lacked)."""
    return {"has_loss_mask": bytes(n), "loss_masks": b"", "version_span_counts": bytes(4 * n), "version_spans": b""}


@dataclass(slots=True, eq=False)
class SampleColumns:
    """A group's samples column by column, as schema v4 stores them (see scored_group.avsc).

    Tokens, logprobs and loss masks are held in parts: one per sample when built from `Sample` objects
    (encoding writes them back to back without joining them first), one view of the record when decoded.
    `spans` holds every version span as a flat (version, start, end, ...) sequence.
    """

    lengths: Sequence[int]
    rewards: list[float | None]
    finish_codes: bytes
    has_logprobs: bytes
    version_counts: Sequence[int]
    versions: Sequence[int]
    has_loss_mask: bytes
    span_counts: Sequence[int]
    spans: Sequence[int]
    text_lengths: Sequence[int]
    text: str
    token_parts: tuple[np.ndarray, ...]
    logprob_parts: tuple[np.ndarray, ...]
    mask_parts: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, samples: Sequence[Sample]) -> SampleColumns:
        text, text_lengths = join_strings([s.text for s in samples])
        return cls(lengths=[len(s.tokens) for s in samples], rewards=[s.reward for s in samples],
                   finish_codes=bytes(_FINISH_CODES[s.finish_reason] for s in samples),
                   has_logprobs=bytes(s.logprobs is not None for s in samples),
                   version_counts=[len(s.weight_versions) for s in samples],
                   versions=[v for s in samples for v in s.weight_versions],
                   has_loss_mask=bytes(s.loss_mask is not None for s in samples),
                   span_counts=[len(s.version_spans) for s in samples],
                   spans=[x for s in samples for span in s.version_spans for x in (span.version, span.start, span.end)],
                   text_lengths=text_lengths, text=text,
                   token_parts=tuple(s.tokens for s in samples),
                   logprob_parts=tuple(s.logprobs for s in samples if s.logprobs is not None),
                   mask_parts=tuple(s.loss_mask for s in samples if s.loss_mask is not None))

    @classmethod
    def decoded(cls, d: Mapping[str, Any]) -> SampleColumns:
        """Columns of a decoded v4 datum; tokens, logprobs and loss masks become views of the record's
        bytes (no copy).

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
        has_mask, masks = d["has_loss_mask"], _masks_of(d, lengths)
        span_counts, spans = _spans_of(d, lengths, counts, versions)
        return cls(lengths=lengths, rewards=[None if r != r else r for r in rewards], finish_codes=finish,
                   has_logprobs=has_logprobs, version_counts=counts, versions=versions, has_loss_mask=has_mask,
                   span_counts=span_counts, spans=spans, text_lengths=text_lengths, text=text,
                   token_parts=(tokens,), logprob_parts=(logprobs,), mask_parts=(masks,))

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> np.ndarray:
        return _joined(self.token_parts, INT32_LE)

    @property
    def logprobs(self) -> np.ndarray:
        return _joined(self.logprob_parts, FLOAT32_LE)

    @property
    def loss_masks(self) -> np.ndarray:
        return _joined(self.mask_parts, UINT8)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.token_parts) + sum(p.nbytes for p in self.logprob_parts)

    def datum(self) -> dict[str, Any]:
        """The sample fields of a v4 ScoredGroup datum."""
        return {
            "response_lengths": pack_values(self.lengths, "i"),
            "rewards": pack_values([math.nan if r is None else r for r in self.rewards], "d"),
            "finish_reasons": self.finish_codes,
            "has_logprobs": self.has_logprobs,
            "weight_version_counts": pack_values(self.version_counts, "i"),
            "weight_versions": pack_values(self.versions, "q"),
            "has_loss_mask": self.has_loss_mask,
            "version_span_counts": pack_values(self.span_counts, "i"),
            "version_spans": pack_values(self.spans, "q"),
            "text_lengths": pack_values(self.text_lengths, "i"),
            "texts": self.text,
            "tokens": self.token_parts,  # contiguous arrays: the codec writes their bytes back to back
            "logprobs": self.logprob_parts,
            "loss_masks": self.mask_parts,
        }

    def samples(self) -> tuple[Sample, ...]:
        """One `Sample` per row; its arrays are views of the columns."""
        tokens, all_logprobs, all_masks, has_mask = self.tokens, self.logprobs, self.loss_masks, self.has_loss_mask
        texts = split_strings(self.text, self.text_lengths)
        spans = self._sample_spans()
        decoded = Sample._decoded  # bound once: one call per sample
        out = []
        token_at = logprob_at = mask_at = version_at = 0
        for i, n in enumerate(self.lengths):
            logprobs = mask = None
            if self.has_logprobs[i]:
                logprobs = all_logprobs[logprob_at:logprob_at + n]
                logprob_at += n
            if has_mask[i]:
                mask = all_masks[mask_at:mask_at + n]
                mask_at += n
            count = self.version_counts[i]
            out.append(decoded(tokens[token_at:token_at + n], texts[i] or "", logprobs, self.rewards[i],
                               FINISH_REASONS[self.finish_codes[i]],
                               tuple(self.versions[version_at:version_at + count]), mask, spans[i] if spans else ()))
            token_at, version_at = token_at + n, version_at + count
        return tuple(out)

    def _sample_spans(self) -> list[tuple[VersionSpan, ...]]:
        """The version spans of each sample, or [] when no sample has any (most records)."""
        if not self.spans:
            return []
        flat, span = self.spans, VersionSpan._decoded  # bound once: one call per span
        every = [span(flat[k], flat[k + 1], flat[k + 2]) for k in range(0, len(flat), 3)]
        out, at = [], 0
        for count in self.span_counts:
            out.append(tuple(every[at:at + count]))
            at += count
        return out


def _masks_of(d: Mapping[str, Any], lengths: Sequence[int]) -> np.ndarray:
    """The loss masks of a decoded datum, a view of its bytes. Raises DecodeError when they disagree with the
    samples. Most records carry none: then two cheap tests are all the work."""
    has_mask, packed = d["has_loss_mask"], d["loss_masks"]
    if len(has_mask) != len(lengths):
        raise DecodeError(f"columns disagree on the number of samples: {len(lengths)} lengths, {len(has_mask)} loss "
                          "mask flags")
    if not packed and not any(has_mask):
        return _NO_MASKS
    masks = unpack(packed, UINT8, "loss_masks")
    _check_masks(lengths, has_mask, masks)
    return masks


def _spans_of(d: Mapping[str, Any], lengths: Sequence[int], version_counts: Sequence[int],
              versions: Sequence[int]) -> tuple[Sequence[int], Sequence[int]]:
    """The version span counts and the flat spans of a decoded datum. Raises DecodeError when they disagree
    with the samples. Most records carry none: then two cheap tests are all the work."""
    packed_counts, packed = d["version_span_counts"], d["version_spans"]
    if len(packed_counts) != 4 * len(lengths):
        raise DecodeError(f"columns disagree on the number of samples: {len(lengths)} lengths, "
                          f"{len(packed_counts)} bytes of version span counts (4 per sample)")
    if not packed and not any(packed_counts):
        return (0,) * len(lengths), ()
    span_counts = unpack_values(packed_counts, "i", "version_span_counts")
    spans = unpack_values(packed, "q", "version_spans")
    _check_spans(lengths, version_counts, versions, span_counts, spans)
    return span_counts, spans


def _check_masks(lengths: Sequence[int], has_mask: bytes, masks: np.ndarray) -> None:
    """Raises DecodeError unless `masks` holds one 0/1 per response token of each sample flagged in `has_mask`."""
    if max(has_mask, default=0) > 1:
        raise DecodeError(f"bad loss mask flags {list(has_mask)}: one 0 or 1 per sample")
    expected = sum(length for length, has in zip(lengths, has_mask, strict=True) if has)
    if masks.size != expected:
        raise DecodeError(f"{masks.size} loss mask entries do not match the {expected} response tokens of the samples "
                          f"that have one (lengths {list(lengths)}, flags {list(has_mask)})")
    if masks.size and masks.max() > 1:
        raise DecodeError(f"loss mask entries must be 0 or 1, found {int(masks.max())}")


def _check_spans(lengths: Sequence[int], version_counts: Sequence[int], versions: Sequence[int],
                 span_counts: Sequence[int], spans: Sequence[int]) -> None:
    """Raises DecodeError unless each sample's spans cover its response back to back and name exactly its
    weight versions (distinct, oldest first), as `Sample` requires."""
    if min(span_counts, default=0) < 0 or 3 * sum(span_counts) != len(spans):
        raise DecodeError(f"{len(spans)} version span numbers do not match the span counts {list(span_counts)} "
                          "(three per span: version, start, end)")
    at = version_at = 0
    for i, count in enumerate(span_counts):
        n_versions = version_counts[i]
        if count:
            end = at + 3 * count
            starts, ends = spans[at + 1:end:3], spans[at + 2:end:3]
            back_to_back = not starts[0] and ends[-1] == lengths[i] and starts[1:] == ends[:-1]
            if not (back_to_back and all(map(operator.lt, starts, ends))):  # and no span empty
                raise DecodeError(f"sample {i}: version spans {spans[at:end]} (version, start, end) do not cover its "
                                  f"{lengths[i]} response tokens back to back")
            own_versions = versions[version_at:version_at + n_versions]
            if tuple(dict.fromkeys(spans[at:end:3])) != own_versions:
                raise DecodeError(f"sample {i}: version spans name versions {tuple(dict.fromkeys(spans[at:end:3]))}, "
                                  f"its weight versions are {own_versions}")
            at = end
        version_at += n_versions


def plain_samples(tokens: Sequence[Sequence[int] | np.ndarray], logprobs: Sequence[Sequence[float] | np.ndarray | None],
                  texts: Sequence[str], rewards: Sequence[float | None], finish_reasons: Sequence[str],
                  versions: Sequence[int]) -> Samples | None:
    """The samples of plain responses (no loss mask, no version spans, one weight version each) held as
    columns, without a `Sample` object per response: what a producer publishes most, built with the
    checks `Sample` makes, once per group. None when a response needs the per-sample path (a logprob
    count that differs from its tokens, a non-finite logprob or reward, an unknown finish reason):
    building `Sample` objects then names the problem.

    Raises:
        InvalidRecordError: a token id or logprob does not fit int32 / float32 (as `Sample` would).
    """
    token_parts = tuple(int32_array(t, "tokens") for t in tokens)
    logprob_parts = tuple(float32_array(lp, "logprobs") for lp in logprobs)
    lengths = [len(t) for t in token_parts]
    if any(lp is not None and len(lp) != n for lp, n in zip(logprob_parts, lengths, strict=True)):
        return None
    present = tuple(lp for lp in logprob_parts if lp is not None)
    if not _all_finite(present):
        return None
    codes = [_FINISH_CODES.get(reason) for reason in finish_reasons]
    scored = [None if r is None else float(r) for r in rewards]
    if None in codes or any(r is not None and math.isinf(r) for r in scored):
        return None
    text, text_lengths = join_strings(texts)
    n = len(token_parts)
    columns = SampleColumns(
        lengths=lengths, rewards=[None if r is None or math.isnan(r) else r for r in scored],
        finish_codes=bytes(codes),  # type: ignore[arg-type]  # no None left: checked above
        has_logprobs=bytes(lp is not None for lp in logprob_parts), version_counts=[1] * n,
        versions=[int(v) for v in versions], has_loss_mask=bytes(n), span_counts=[0] * n, spans=(),
        text_lengths=text_lengths, text=text, token_parts=token_parts, logprob_parts=present, mask_parts=())
    return Samples._of_columns(columns)


_LOCK_HELD_ELEMENTS = 500  # numpy releases the interpreter lock for a loop over more elements than this


def _all_finite(parts: tuple[np.ndarray, ...]) -> bool:
    """Whether every value of `parts` is finite, with as few releases of the interpreter lock as can be: on
    the event loop each release may wait for the lock behind another thread (intake, delivery reports).
    Short parts are checked one by one (numpy keeps the lock), long ones joined (three releases in all)."""
    if all(len(part) <= _LOCK_HELD_ELEMENTS for part in parts):
        return all(np.isfinite(part).all() for part in parts)
    return bool(np.isfinite(_joined(parts, FLOAT32_LE)).all())


def samples_datum(samples: Sequence[Sample]) -> dict[str, Any]:
    """The sample fields of a v4 ScoredGroup datum for `samples`, as the codec reads them back."""
    return as_read(SampleColumns.of(samples).datum())


def _group_datum(group: ScoredGroup) -> dict[str, Any]:
    held = group.samples.columns
    if isinstance(held, SampleColumns):
        columns = held
    else:
        columns = SampleColumns.of(group.samples.items())
        group.samples._hold_columns(columns)
    return {
        "group_id": group.group_id,
        "prompt_id": group.prompt_id,
        "epoch": group.epoch,
        "status": group.status.upper(),
        "error": group.error,
        "producer_id": group.producer_id,
        "started_at_ms": group.started_at_ms,
        "finished_at_ms": group.finished_at_ms,
        "prompt": group.prompt,
        "metadata": dict(group.metadata),
        "sampling": None if group.sampling is None else vars(group.sampling),
        "attempt": group.attempt,
        "max_attempts": group.max_attempts,
        "retriable": group.retriable,
        "source_prompt": group.source_prompt,
        **columns.datum(),
        "prompt_tokens": group.prompt_tokens,  # a contiguous array: the codec writes its bytes
    }


def _group_from_datum(d: Mapping[str, Any]) -> ScoredGroup:
    """A group from a decoded v5 datum. Raises DecodeError where fields disagree (Avro cannot check that),
    InvalidRecordError for sampling parameters out of range (the codec reports both as DecodeError)."""
    if d["status"] == "FAILED" and not d["error"]:
        raise DecodeError(f"failed group {d['group_id']!r} carries no error")
    return ScoredGroup._decoded(
        group_id=d["group_id"],
        prompt_id=d["prompt_id"],
        epoch=d["epoch"],
        prompt=d["prompt"],
        prompt_tokens=unpack(d["prompt_tokens"], INT32_LE, "prompt_tokens"),
        samples=Samples._of_columns(SampleColumns.decoded(d)),
        producer_id=d["producer_id"],
        started_at_ms=d["started_at_ms"],
        finished_at_ms=d["finished_at_ms"],
        status=d["status"].lower(),
        error=d["error"],
        metadata=d["metadata"],
        sampling=None if (sampling := d["sampling"]) is None else Sampling(**sampling),
        attempt=d["attempt"],
        max_attempts=d["max_attempts"],
        retriable=d["retriable"],
        source_prompt=d["source_prompt"],
    )


def dispositions_datum(dispositions: Sequence[OffsetDisposition]) -> dict[str, Any]:
    """The disposition columns of a v3 StepManifest datum."""
    ids, id_lengths = join_strings([d.group_id for d in dispositions])
    attempts = [d.attempt for d in dispositions]
    return {
        "partitions": pack_values([d.partition for d in dispositions], "i"),
        "offsets": pack_values([d.offset for d in dispositions], "q"),
        "kinds": bytes(_KIND_CODES[d.kind] for d in dispositions),
        "group_id_lengths": pack_values(id_lengths, "i"),
        "group_ids": ids,
        "reasons": [{"index": n, "reason": d.reason} for n, d in enumerate(dispositions) if d.reason is not None],
        "attempts": pack_values(attempts, "i") if any(attempts) else b"",
    }


def _manifest_datum(manifest: StepManifest) -> dict[str, Any]:
    return {
        "step": manifest.step,
        "consumer_group": manifest.consumer_group,
        "topic": manifest.topic,
        "created_at_ms": manifest.created_at_ms,
        "policy_version": manifest.policy_version,
        "ranges": [vars(r) for r in manifest.ranges],
        **dispositions_datum(manifest.dispositions),
    }


def _manifest_from_datum(d: Mapping[str, Any]) -> StepManifest:
    return StepManifest(step=d["step"], consumer_group=d["consumer_group"], topic=d["topic"],
                        created_at_ms=d["created_at_ms"], policy_version=d["policy_version"],
                        ranges=tuple(PartitionRange(**r) for r in d["ranges"]), dispositions=_dispositions(d))


def _dispositions(d: Mapping[str, Any]) -> tuple[OffsetDisposition, ...]:
    """The dispositions of a v3 manifest datum. Raises DecodeError when its columns disagree."""
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
    group_ids = split_strings(ids, lengths)
    attempts = unpack_values(d["attempts"], "i", "attempts") if d["attempts"] else (0,) * n
    if len(attempts) != n or min(attempts, default=0) < 0:
        raise DecodeError(f"manifest has {len(attempts)} attempts (none below 0) for {n} dispositions")
    decoded = OffsetDisposition._decoded  # bound once: one call per offset of the step
    return tuple(decoded(partitions[i], offsets[i], DISPOSITION_KINDS[kinds[i]], group_ids[i], reasons.get(i),
                         attempts[i]) for i in range(n))


def _prompt_from_datum(d: Mapping[str, Any]) -> Prompt:
    return Prompt(id=d["id"], prompt=d["prompt"], epoch=d["epoch"], label=d["label"], metadata=d["metadata"],
                  attempt=d["attempt"])


def _policy_version_datum(version: PolicyVersion) -> dict[str, Any]:
    return {"version": version.version, "weights_path": version.weights_path,
            "created_at_ms": version.created_at_ms, "metadata": dict(version.metadata)}


def _position_datum(position: TrainerPosition) -> dict[str, Any]:
    partitions = sorted(position.committed)
    return {"consumer_group": position.consumer_group, "topic": position.topic, "step": position.step,
            "partitions": partitions, "committed": [position.committed[p] for p in partitions],
            "ends": [position.ends[p] for p in partitions], "observed_at_ms": position.observed_at_ms,
            "created_at_ms": position.created_at_ms}


def _position_from_datum(d: Mapping[str, Any]) -> TrainerPosition:
    if not len(d["partitions"]) == len(d["committed"]) == len(d["ends"]):
        raise DecodeError(f"trainer position of {d['consumer_group']}: {len(d['partitions'])} partitions, "
                          f"{len(d['committed'])} committed offsets, {len(d['ends'])} end offsets")
    return TrainerPosition(consumer_group=d["consumer_group"], topic=d["topic"], step=d["step"],
                           committed=dict(zip(d["partitions"], d["committed"], strict=True)),
                           ends=dict(zip(d["partitions"], d["ends"], strict=True)),
                           observed_at_ms=d["observed_at_ms"], created_at_ms=d["created_at_ms"])


@dataclass(frozen=True)
class Layout:
    """How one record type maps to the datum of its current schema, and back."""

    to_datum: Callable[[Any], dict[str, Any]]
    from_datum: Callable[[Mapping[str, Any]], Any]


LAYOUTS: dict[type, Layout] = {
    Prompt: Layout(Prompt.to_dict, _prompt_from_datum),  # the dict generate functions get is the datum
    ScoredGroup: Layout(_group_datum, _group_from_datum),
    StepManifest: Layout(_manifest_datum, _manifest_from_datum),
    PolicyVersion: Layout(_policy_version_datum, lambda d: PolicyVersion(**d)),
    TrainerPosition: Layout(_position_datum, _position_from_datum),
}
