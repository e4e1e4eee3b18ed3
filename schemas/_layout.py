"""The current wire layout of every record: the datum (plain dict) the codec writes with each schema in
``avro/`` and reads back. Only this module knows it; records know nothing of the wire, and `_upgrade`
turns data of older schemas into this layout, so nothing here knows an older one.

A ScoredGroup (schema v7) stores its samples column by column (`SampleColumns`, packed), a StepManifest
(v3) its dispositions: each column holds one entry per row, packed little-endian (the ``doc`` of each
field says how). Strings of many rows are stored back to back with their lengths (`join_strings`).

Decoding builds no `Sample` until `group.samples` is used: the packed columns become `SampleColumns`
(token arrays are views of the record's bytes) and `Samples.from_columns` checks them as every group is
checked, so building the samples later cannot fail. What is checked here is only what the packing itself
can get wrong (sizes that are no multiple of the packed type). A Prompt's datum is built here too: the
dict plug-ins receive is `Prompt.plugin_dict`, a contract of its own. Pure and thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from rollstream.schemas._errors import DecodeError
from rollstream.schemas._packing import FLOAT32_LE, INT32_LE, UINT8, pack_values, unpack, unpack_values
from rollstream.schemas._samples import SampleColumns
from rollstream.schemas.inflight import InflightCheckpoint
from rollstream.schemas.records import (
    DISPOSITION_KINDS,
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
)

_KIND_CODES = {kind: code for code, kind in enumerate(DISPOSITION_KINDS)}


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


def as_read(datum: Mapping[str, Any]) -> dict[str, Any]:
    """`datum` as the codec reads it back: each packed field given as an array or in parts (a tuple of
    arrays, which encoding writes back to back without joining them) as one `bytes`."""
    return {k: b"".join(v) if isinstance(v, tuple) else v.tobytes() if isinstance(v, np.ndarray) else v
            for k, v in datum.items()}


def unmasked_columns(n: int) -> dict[str, bytes]:
    """The loss-mask and version-span columns of `n` samples that carry neither (what older schemas lacked)."""
    return {"has_loss_mask": bytes(n), "loss_masks": b"", "version_span_counts": bytes(4 * n), "version_spans": b""}


NOT_RESUMED: Mapping[str, Any] = {"resume_point_counts": b"", "resume_points": b"", "resumed_from_lengths": b"",
                                  "resumed_from": ""}
"""The resume columns of a group none of whose samples resumed (what schemas before v7 lacked)."""


def columns_datum(c: SampleColumns) -> dict[str, Any]:
    """The sample fields of a ScoredGroup datum (v4 to v7 store the columns they share alike)."""
    return {
        "response_lengths": pack_values(c.lengths, "i"),
        "rewards": pack_values([math.nan if r is None else r for r in c.rewards], "d"),
        "finish_reasons": c.finish_codes,
        "has_logprobs": c.has_logprobs,
        "weight_version_counts": pack_values(c.version_counts, "i"),
        "weight_versions": pack_values(c.versions, "q"),
        "has_loss_mask": c.has_loss_mask,
        "version_span_counts": pack_values(c.span_counts, "i"),
        "version_spans": pack_values(c.spans, "q"),
        **(_resumes_datum(c) if c.resume_counts else NOT_RESUMED),
        "text_lengths": pack_values(c.text_lengths, "i"),
        "texts": c.text,
        "tokens": c.token_parts,  # contiguous arrays: the codec writes their bytes back to back
        "logprobs": c.logprob_parts,
        "loss_masks": c.mask_parts,
    }


def _resumes_datum(c: SampleColumns) -> dict[str, Any]:
    ids, lengths = join_strings(c.resumed_from)
    return {"resume_point_counts": pack_values(c.resume_counts, "i"),
            "resume_points": pack_values(c.resume_points, "i"),
            "resumed_from_lengths": pack_values(lengths, "i"), "resumed_from": ids}


def samples_of_datum(d: Mapping[str, Any]) -> Samples:
    """The samples of a decoded datum, checked (`Samples.from_columns`, all but the values: see
    `check_columns`); tokens, logprobs and loss masks are views of the record's bytes (no copy).

    Raises:
        DecodeError: a packed column is no whole number of its type.
        InvalidRecordError: the columns break a sample invariant (the codec reports it as a DecodeError).
    """
    lengths = unpack_values(d["response_lengths"], "i", "response_lengths")
    n = len(lengths)
    span_counts, spans = _spans_of(d, n)
    resumes = _resumes_of(d) if (d["resume_point_counts"] or d["resume_points"] or d["resumed_from_lengths"]
                                 or d["resumed_from"]) else {}  # most groups: four empty columns
    return Samples.from_columns(SampleColumns(
        lengths=lengths,
        rewards=[None if r != r else r for r in unpack_values(d["rewards"], "d", "rewards")],  # NaN: no score
        finish_codes=d["finish_reasons"], has_logprobs=d["has_logprobs"],
        version_counts=unpack_values(d["weight_version_counts"], "i", "weight_version_counts"),
        versions=unpack_values(d["weight_versions"], "q", "weight_versions"), has_loss_mask=d["has_loss_mask"],
        span_counts=span_counts, spans=spans,
        text_lengths=unpack_values(d["text_lengths"], "i", "text_lengths"), text=d["texts"],
        token_parts=(unpack(d["tokens"], INT32_LE, "tokens"),),
        logprob_parts=(unpack(d["logprobs"], FLOAT32_LE, "logprobs"),),
        mask_parts=(unpack(d["loss_masks"], UINT8, "loss_masks"),) if d["loss_masks"] else (), **resumes),
        values=False)


def _spans_of(d: Mapping[str, Any], n: int) -> tuple[Sequence[int], Sequence[int]]:
    """The version span counts and the flat spans of a decoded datum of `n` samples. Most records carry
    none: then two cheap tests are all the work."""
    packed_counts, packed = d["version_span_counts"], d["version_spans"]
    if len(packed_counts) != 4 * n:
        raise DecodeError(f"columns disagree on the number of samples: {n} lengths, "
                          f"{len(packed_counts)} bytes of version span counts (4 per sample)")
    if not packed and not any(packed_counts):
        return (0,) * n, ()
    return unpack_values(packed_counts, "i", "version_span_counts"), unpack_values(packed, "q", "version_spans")


def _resumes_of(d: Mapping[str, Any]) -> dict[str, Any]:
    """The resume columns of a decoded datum whose samples resumed (`check_columns` checks them against
    the samples); DecodeError when the producer ids do not split by their lengths."""
    lengths = unpack_values(d["resumed_from_lengths"], "i", "resumed_from_lengths")
    ids = d["resumed_from"]
    if min(lengths, default=0) < 0 or sum(lengths) != len(ids):
        raise DecodeError(f"resumed_from is {len(ids)} characters, its lengths {list(lengths)} say otherwise")
    return {"resume_counts": unpack_values(d["resume_point_counts"], "i", "resume_point_counts"),
            "resume_points": unpack_values(d["resume_points"], "i", "resume_points"),
            "resumed_from": split_strings(ids, lengths)}


def samples_datum(samples: Sequence[Sample]) -> dict[str, Any]:
    """The sample fields of a ScoredGroup datum for `samples`, as the codec reads them back."""
    return as_read(columns_datum(Samples(samples).columns))


def _group_datum(group: ScoredGroup) -> dict[str, Any]:
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
        "policy_run": group.policy_run,
        **columns_datum(group.samples.columns),
        "prompt_tokens": group.prompt_tokens,  # a contiguous array: the codec writes its bytes
    }


def _group_from_datum(d: Mapping[str, Any]) -> ScoredGroup:
    """A group from a decoded v7 datum, checked by its constructors (what they refuse raises
    InvalidRecordError, which the codec reports as a DecodeError)."""
    return ScoredGroup(
        group_id=d["group_id"],
        prompt_id=d["prompt_id"],
        epoch=d["epoch"],
        prompt=d["prompt"],
        prompt_tokens=unpack(d["prompt_tokens"], INT32_LE, "prompt_tokens"),
        samples=samples_of_datum(d),
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
        policy_run=d["policy_run"],
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
    row = OffsetDisposition._checked  # the rules of its constructor, checked above for every row at once
    return tuple(row(partitions[i], offsets[i], DISPOSITION_KINDS[kinds[i]], group_ids[i], reasons.get(i),
                     attempts[i]) for i in range(n))


def _prompt_datum(prompt: Prompt) -> dict[str, Any]:
    text = prompt.prompt
    return {"id": prompt.id, "prompt": text if isinstance(text, str) else [vars(m) for m in text],
            "label": prompt.label, "metadata": dict(prompt.metadata), "epoch": prompt.epoch, "attempt": prompt.attempt}


def _prompt_from_datum(d: Mapping[str, Any]) -> Prompt:
    return Prompt(id=d["id"], prompt=d["prompt"], epoch=d["epoch"], label=d["label"], metadata=d["metadata"],
                  attempt=d["attempt"])


def _policy_version_datum(version: PolicyVersion) -> dict[str, Any]:
    return {"version": version.version, "weights_path": version.weights_path,
            "created_at_ms": version.created_at_ms, "metadata": dict(version.metadata), "run": version.run,
            "run_id": version.run_id}


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


def _checkpoint_datum(c: InflightCheckpoint) -> dict[str, Any]:
    return {"group_id": c.group_id, "prompt_id": c.prompt_id, "attempt": c.attempt, "sample_index": c.sample_index,
            "prompt_partition": c.prompt_partition, "prompt_offset": c.prompt_offset, "producer_id": c.producer_id,
            "written_at_ms": c.written_at_ms, "policy_run": c.policy_run, "finish_reason": c.finish_reason,
            "policy_turns": c.policy_turns, "environment_state": c.environment_state,
            "resume_points": list(c.resume_points), "resumed_from": list(c.resumed_from), "text": c.text,
            "has_logprobs": c.logprobs is not None, "version_spans": _runs(c.versions).tobytes(),
            "loss_mask": b"" if c.loss_mask is None else c.loss_mask.tobytes(),
            "logprobs": b"" if c.logprobs is None else c.logprobs.tobytes(), "tokens": c.tokens.tobytes(),
            "prompt_tokens": b"" if c.prompt_tokens is None else c.prompt_tokens.tobytes()}


def _checkpoint_from_datum(d: Mapping[str, Any]) -> InflightCheckpoint:
    return InflightCheckpoint(
        group_id=d["group_id"], prompt_id=d["prompt_id"], attempt=d["attempt"], sample_index=d["sample_index"],
        prompt_partition=d["prompt_partition"], prompt_offset=d["prompt_offset"], producer_id=d["producer_id"],
        written_at_ms=d["written_at_ms"], policy_run=d["policy_run"], finish_reason=d["finish_reason"],
        policy_turns=d["policy_turns"], environment_state=d["environment_state"],
        resume_points=tuple(d["resume_points"]), resumed_from=tuple(d["resumed_from"]), text=d["text"],
        tokens=unpack(d["tokens"], INT32_LE, "tokens"),
        prompt_tokens=unpack(d["prompt_tokens"], INT32_LE, "prompt_tokens") if d["prompt_tokens"] else None,
        logprobs=unpack(d["logprobs"], FLOAT32_LE, "logprobs") if d["has_logprobs"] else None,
        loss_mask=unpack(d["loss_mask"], UINT8, "loss_mask") if d["loss_mask"] else None,
        versions=_expanded(unpack(d["version_spans"], np.dtype("<i8"), "version_spans"), len(d["tokens"]) // 4))


def _runs(versions: np.ndarray) -> np.ndarray:
    """Per-token versions (-1: unknown) as (version, start, end) triplets of their runs of known versions."""
    if not len(versions):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.diff(versions, prepend=versions[0] - 1))
    ends = np.append(starts[1:], len(versions))
    runs = np.stack([versions[starts], starts, ends], axis=1)
    return runs[runs[:, 0] >= 0].astype("<i8").ravel()


def _expanded(spans: np.ndarray, n: int) -> np.ndarray:
    """`_runs` back to per-token versions. Raises DecodeError for triplets that do not fit `n` tokens."""
    if len(spans) % 3:
        raise DecodeError(f"checkpoint version_spans hold {len(spans)} numbers, no whole (version, start, end)")
    versions = np.full(n, -1, np.int64)
    for version, start, end in spans.reshape(-1, 3).tolist():
        if not 0 <= start <= end <= n:
            raise DecodeError(f"checkpoint version span [{start}, {end}) outside its {n} tokens")
        versions[start:end] = version
    return versions


@dataclass(frozen=True)
class Layout:
    """How one record type maps to the datum of its current schema, and back."""

    to_datum: Callable[[Any], dict[str, Any]]
    from_datum: Callable[[Mapping[str, Any]], Any]


LAYOUTS: dict[type, Layout] = {
    Prompt: Layout(_prompt_datum, _prompt_from_datum),
    ScoredGroup: Layout(_group_datum, _group_from_datum),
    StepManifest: Layout(_manifest_datum, _manifest_from_datum),
    PolicyVersion: Layout(_policy_version_datum, lambda d: PolicyVersion(**d)),
    TrainerPosition: Layout(_position_datum, _position_from_datum),
    InflightCheckpoint: Layout(_checkpoint_datum, _checkpoint_from_datum),
}
