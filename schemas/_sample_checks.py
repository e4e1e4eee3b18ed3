"""The one statement of what a sample must be: `check_columns` checks every invariant of every row of a
group's `SampleColumns`, whoever built them (`Sample` on its one row, `Samples.from_columns` on a group:
`plain_samples` and decoding). Errors name the field, the sample (in a group) and the lengths.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from rollstream.schemas._errors import InvalidRecordError

if TYPE_CHECKING:
    from rollstream.schemas._samples import SampleColumns

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")  # the one definition: engines and _layout import it
FINISH_CODES: dict[str, int] = {reason: code for code, reason in enumerate(FINISH_REASONS)}
_LOCK_HELD_ELEMENTS = 500  # numpy releases the interpreter lock for a loop over more elements than this


def finish_code(reason: str) -> int:
    """The code of a finish reason (its index in `FINISH_REASONS`). Raises InvalidRecordError for another."""
    code = FINISH_CODES.get(reason)
    if code is None:
        raise InvalidRecordError(f"finish_reason {reason!r} is not one of {', '.join(FINISH_REASONS)}")
    return code


def check_columns(c: SampleColumns, *, values: bool = True) -> None:
    """Every invariant of a sample, checked for each row of `c`: the columns agree on the number of
    samples and on their lengths, codes are in range, loss masks hold one 0/1 per response token, version
    spans cover each response back to back, oldest first, naming exactly its weight versions, resume points
    are ascending token indices of the response, each with the producer id it resumed from, and (with
    `values`) logprobs and rewards are finite. Cheap where a group has no masks, spans or resume points
    (most groups).

    Decoding passes ``values=False``: the producer that wrote the record checked its values, and a scan of
    every logprob would add ~5 us to the ~24 us of decoding a 100 KB group (and release the interpreter
    lock); what decoding must check is what would make building the samples fail later: all the rest.

    Raises:
        InvalidRecordError: the first invariant broken, naming the field, the sample and the lengths.
    """
    lengths, n = c.lengths, len(c.lengths)
    if not (len(c.rewards) == len(c.finish_codes) == len(c.has_logprobs) == len(c.version_counts)
            == len(c.text_lengths) == len(c.has_loss_mask) == len(c.span_counts) == n):
        raise InvalidRecordError(
            f"columns disagree on the number of samples: {n} lengths, {len(c.rewards)} rewards, "
            f"{len(c.finish_codes)} finish reasons, {len(c.has_logprobs)} logprob flags, {len(c.version_counts)} "
            f"weight version counts, {len(c.text_lengths)} text lengths, {len(c.has_loss_mask)} loss mask flags, "
            f"{len(c.span_counts)} version span counts")
    if n and (min(lengths) < 0 or min(c.version_counts) < 0 or min(c.text_lengths) < 0
              or max(c.finish_codes) >= len(FINISH_REASONS) or max(c.has_logprobs) > 1):
        raise InvalidRecordError(f"bad sample columns: lengths {list(lengths)}, weight version counts "
                                 f"{list(c.version_counts)}, text lengths {list(c.text_lengths)}, finish codes "
                                 f"{list(c.finish_codes)}, logprob flags {list(c.has_logprobs)}")
    _check_parts(c.token_parts, lengths, "response tokens")
    if sum(c.version_counts) != len(c.versions) or sum(c.text_lengths) != len(c.text):
        raise InvalidRecordError(f"{len(c.versions)} weight versions and {len(c.text)} text characters do not "
                                 f"match the samples' counts {list(c.version_counts)} and text lengths "
                                 f"{list(c.text_lengths)}")
    has_logprobs = c.has_logprobs
    _check_parts(c.logprob_parts, lengths if 0 not in has_logprobs else  # most groups: every sample has them
                 [m for m, has in zip(lengths, has_logprobs, strict=True) if has], "logprobs")
    if values:
        _check_finite(c.logprob_parts, c.rewards)
    _check_masks(c)
    if c.spans or any(c.span_counts):
        _check_spans(c)
    if c.resume_counts or c.resume_points or c.resumed_from:
        _check_resumes(c)


_PART_NOUNS = {"response tokens": "response tokens", "logprobs": "logprobs", "loss_mask": "loss mask entries"}


def _check_parts(parts: tuple[np.ndarray, ...], sizes: Sequence[int], field: str) -> None:
    """Raises unless `parts` hold `sizes` values: one part in all, or one per size (none when all are 0)."""
    if len(parts) == 1:
        if parts[0].size == sum(sizes):
            return
    elif [p.size for p in parts] == list(sizes) or (not parts and not any(sizes)):
        return
    total, expected = sum(p.size for p in parts), sum(sizes)
    lead = f"loss_mask has {total} entries for {expected} tokens: " if field == "loss_mask" else ""
    raise InvalidRecordError(f"{lead}{total} {_PART_NOUNS[field]} do not match the {expected} response tokens of "
                             f"the samples that have them (lengths {list(sizes)}, in {len(parts)} parts); give one "
                             "per response token, or none")


def _check_finite(logprob_parts: tuple[np.ndarray, ...], rewards: Sequence[float | None]) -> None:
    if not _all_finite(logprob_parts):
        bad = sum(int((~np.isfinite(p)).sum()) for p in logprob_parts)
        raise InvalidRecordError(f"{bad} of {sum(p.size for p in logprob_parts)} logprobs are NaN or infinite; "
                                 "give finite ones")
    for reward in rewards:  # NaN is no score: builders give None for it
        if reward is not None and not math.isfinite(reward):
            raise InvalidRecordError(f"reward {reward} is not a finite number")


def _all_finite(parts: tuple[np.ndarray, ...]) -> bool:
    """Whether every value of `parts` is finite, with as few releases of the interpreter lock as can be: on
    the event loop each release may wait for the lock behind another thread (intake, delivery reports).
    Short parts are checked one by one (numpy keeps the lock), long ones joined (three releases in all)."""
    if all(len(part) <= _LOCK_HELD_ELEMENTS for part in parts):
        return all(np.isfinite(part).all() for part in parts)
    return bool(np.isfinite(np.concatenate(parts)).all())


def _check_masks(c: SampleColumns) -> None:
    if not c.mask_parts and not any(c.has_loss_mask):
        return
    if max(c.has_loss_mask, default=0) > 1:
        raise InvalidRecordError(f"bad loss mask flags {list(c.has_loss_mask)}: one 0 or 1 per sample")
    _check_parts(c.mask_parts, [m for m, has in zip(c.lengths, c.has_loss_mask, strict=True) if has], "loss_mask")
    top = max((int(p.max()) for p in c.mask_parts if p.size), default=0)
    if top > 1:
        size = sum(p.size for p in c.mask_parts)
        raise InvalidRecordError(f"loss_mask has {size} entries for {size} tokens; give one 0 or 1 per response token "
                                 f"(0: a tool or environment token): loss mask entries must be 0 or 1, found {top}")


def _check_spans(c: SampleColumns) -> None:
    """Each sample's spans cover its response back to back, none empty, oldest first, and name exactly its
    weight versions (distinct, oldest first)."""
    spans, span_counts = c.spans, c.span_counts
    if min(span_counts, default=0) < 0 or 3 * sum(span_counts) != len(spans):
        raise InvalidRecordError(f"{len(spans)} version span numbers do not match the span counts "
                                 f"{list(span_counts)} (three per span: version, start, end)")
    at = version_at = 0
    for i, count in enumerate(span_counts):
        n_versions = c.version_counts[i]
        where = f"sample {i}: " if len(span_counts) > 1 else ""  # a sample checked alone needs no index
        if count:
            end = at + 3 * count
            versions, starts, ends = spans[at:end:3], spans[at + 1:end:3], spans[at + 2:end:3]
            _check_cover(where, c.lengths[i], spans[at:end], starts, ends)
            named, own = tuple(dict.fromkeys(versions)), tuple(c.versions[version_at:version_at + n_versions])
            if named != own:
                raise InvalidRecordError(f"{where}version spans name versions {named}, its weight versions "
                                         f"are {own}")
            if list(versions) != sorted(versions):
                raise InvalidRecordError(f"{where}version spans must be oldest first, got versions "
                                         f"{list(versions)}")
            at = end
        version_at += n_versions


def _check_cover(where: str, length: int, flat: Sequence[int], starts: Sequence[int], ends: Sequence[int]) -> None:
    if not starts[0] and ends[-1] == length and starts[1:] == ends[:-1] and all(map(operator.lt, starts, ends)):
        return
    why = f"version spans end at token {ends[-1]}, but the sample has {length} tokens"
    cursor = 0
    for version, start, stop in zip(flat[::3], starts, ends, strict=True):
        if start != cursor:
            why = f"the span of version {version} [{start}, {stop}) starts at {start}, expected {cursor}"
            break
        if stop <= start:
            why = f"the span of version {version} [{start}, {stop}) is empty"
            break
        cursor = stop
    raise InvalidRecordError(f"{where}{why}: version spans {list(flat)} (version, start, end) do not cover its "
                             f"{length} response tokens back to back")


def _check_resumes(c: SampleColumns) -> None:
    """Each sample's resume points are token indices of its response (0 <= i <= its length), ascending (a
    point repeats when a producer resumed and was killed before its first new token), each with a producer id."""
    counts, points, n = c.resume_counts, c.resume_points, len(c.lengths)
    if len(counts) != n or min(counts, default=0) < 0 or not sum(counts) == len(points) == len(c.resumed_from):
        raise InvalidRecordError(f"{len(points)} resume points and {len(c.resumed_from)} producer ids they resumed "
                                 f"from do not match the resume point counts {list(counts)} of {n} samples; give "
                                 "one producer id per resume point")
    at = 0
    for i, count in enumerate(counts):
        if not count:
            continue
        own, length = list(points[at:at + count]), c.lengths[i]
        if own[0] < 0 or own[-1] > length or own != sorted(own):
            where = f"sample {i}: " if n > 1 else ""
            raise InvalidRecordError(f"{where}resume points {own} must be ascending token indices in 0..{length} "
                                     f"(the response has {length} tokens)")
        at += count
