"""Steps (or offset ranges) of NS.rollouts as a Parquet file: one row per sample, readable by pandas, DuckDB
and `datasets.load_dataset("parquet", ...)` as it is.

The columns (`COLUMNS`; the names are the public contract) say, for each sample: where its record is
(`partition`, `offset`, `timestamp_ms`), which step covered it and what that step did with its group
(`step`, `disposition`: taken / filtered / duplicate / undecodable / requeued, `reason`), the group
(`group_id`, `prompt_id`, `epoch`, `attempt`, `producer_id`, `policy_run`, `prompt`, `status`, `error`), the
sample (`sample_index`, `text`, `reward`, `advantage`, `finish_reason`, `weight_version`: its oldest policy
version, `trainer_version`: the trainer's at the step, `staleness`: their difference, `resumed`: whether its
generation resumed from another producer's in-flight checkpoint) and its response tokens as list columns
(`tokens`, `logprobs`, `loss_mask`, `token_versions`, `resume_points`: the token indices where it resumed,
`resumed_from`: whose checkpoint each continued). A record without samples (undecodable, or a failed group)
is one row with `sample_index` null, so every offset is accounted for.

`advantage` is the group-normalised advantage `Batch.to_tensors` trains on (`grpo_advantages`, eps 1e-6), for
every group whose samples all have a reward (what it would have been, for a filtered one); null otherwise.
`loss_mask` is 1 on every token when the sample has none (what `to_tensors` trains on), and `token_versions`
is `Sample.token_versions()` (-1: unknown).

Written with pyarrow (the ``export`` extra, imported only here) one row group at a time, each as soon as
`ROW_GROUP_ROWS` rows or `ROW_GROUP_TOKENS` tokens are buffered: memory stays bounded however long the range.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rollstream.consumers._batch import grpo_advantages
from rollstream.consumers.forensics._replay import Progress
from rollstream.consumers.forensics._step_read import Covered, CoveredStep, read_range, read_steps, steps_between
from rollstream.infra import KafkaConfig
from rollstream.schemas import RollstreamError, ScoredGroup

if TYPE_CHECKING:
    import pyarrow as pa

ROW_GROUP_ROWS = 20_000
ROW_GROUP_TOKENS = 4_000_000  # ~70 MB of token, logprob, mask and version values buffered at most

_SCALARS: tuple[tuple[str, str], ...] = (
    ("step", "int64"), ("disposition", "string"), ("reason", "string"), ("group_id", "string"),
    ("prompt_id", "string"), ("epoch", "int64"), ("attempt", "int64"), ("producer_id", "string"),
    ("policy_run", "int64"), ("sample_index", "int32"), ("prompt", "string"), ("text", "string"),
    ("reward", "float64"), ("advantage", "float64"), ("finish_reason", "string"), ("weight_version", "int64"),
    ("trainer_version", "int64"), ("staleness", "int64"), ("resumed", "bool_"),
)
_LISTS: tuple[tuple[str, str], ...] = (
    ("tokens", "int32"), ("logprobs", "float32"), ("loss_mask", "int8"), ("token_versions", "int64"),
    ("resume_points", "int32"),
)
_TEXT_LISTS: tuple[tuple[str, str], ...] = (("resumed_from", "string"),)
_CONTEXT: tuple[tuple[str, str], ...] = (
    ("partition", "int32"), ("offset", "int64"), ("timestamp_ms", "int64"), ("status", "string"),
    ("error", "string"), ("started_at_ms", "int64"), ("finished_at_ms", "int64"), ("step_created_at_ms", "int64"),
    ("metadata", "string"),
)
COLUMNS: tuple[str, ...] = tuple(name for name, _ in (*_SCALARS, *_LISTS, *_TEXT_LISTS, *_CONTEXT))
"""The exported columns, in file order."""
_PER_SAMPLE = ("sample_index", "text", "reward", "advantage", "finish_reason", "weight_version", "staleness",
               "resumed", "resumed_from")
_SHARED = tuple(name for name, _ in (*_SCALARS, *_CONTEXT) if name not in _PER_SAMPLE)
_ONES = np.ones(1 << 16, np.int8)  # sliced (never written): the loss mask of a sample without one
_NOT_RESUMED = np.empty(0, np.int32)  # the resume points of a sample that never resumed (most)


@dataclass(frozen=True)
class ExportSummary:
    """What an export wrote: `rows` (samples, plus one per record without any), `records` (offsets read),
    `steps` (steps covered), `row_groups`, and the file's `path` and `bytes`."""

    path: Path
    rows: int
    records: int
    steps: int
    row_groups: int
    bytes: int


def require_pyarrow() -> Any:
    """pyarrow, or a RollstreamError that says how to install it."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401 - the writer lives in the submodule
    except ImportError:
        raise RollstreamError("export needs pyarrow: pip install 'rollstream[export]'") from None
    return pyarrow


def schema() -> pa.Schema:
    """The Arrow schema of an export (`COLUMNS`, typed)."""
    pa = require_pyarrow()
    fields = [pa.field(n, getattr(pa, t)()) for n, t in (*_SCALARS, *_CONTEXT)]
    fields += [pa.field(n, pa.list_(getattr(pa, t)())) for n, t in (*_LISTS, *_TEXT_LISTS)]
    by_name = {f.name: f for f in fields}
    return pa.schema([by_name[n] for n in COLUMNS])


def write_steps(steps: Iterable[CoveredStep], path: Path) -> ExportSummary:
    """Write every sample of `steps` to the Parquet file `path` (replaced), step by step. Blocks until
    written; holds at most one row group in memory besides what `steps` holds.

    Raises:
        RollstreamError: pyarrow is not installed; OSError when the file cannot be written.
    """
    count = 0

    def flattened() -> Iterator[Covered]:
        nonlocal count
        for step in steps:
            count += 1
            yield from step.records

    summary = write_records(flattened(), path)
    return ExportSummary(summary.path, summary.rows, summary.records, count, summary.row_groups, summary.bytes)


def write_records(records: Iterable[Covered], path: Path) -> ExportSummary:
    """Write every sample of `records` to the Parquet file `path` (replaced), in the order given. Blocks
    until written. Raises as `write_steps`; `steps` in the summary counts the distinct steps seen."""
    pa = require_pyarrow()
    import pyarrow.parquet as pq

    out_schema = schema()
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    buffer = _Rows()
    rows = records_read = row_groups = 0
    steps: set[int] = set()
    with pq.ParquetWriter(tmp, out_schema, compression="zstd") as writer:
        for covered in records:
            records_read += 1
            if covered.manifest is not None:
                steps.add(covered.manifest.step)
            buffer.add(covered)
            if buffer.full():
                rows, row_groups = rows + buffer.rows, row_groups + 1
                writer.write_table(buffer.table(pa, out_schema))
                buffer = _Rows()
        if buffer.rows or not row_groups:
            rows, row_groups = rows + buffer.rows, row_groups + 1
            writer.write_table(buffer.table(pa, out_schema))
    tmp.replace(path)  # a killed export leaves no truncated file under the name asked for
    return ExportSummary(path, rows, records_read, len(steps), row_groups, path.stat().st_size)


class _Rows:
    """Rows buffered for one row group: scalar columns as lists, list columns as arrays (joined once)."""

    def __init__(self) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name, _ in (*_SCALARS, *_TEXT_LISTS, *_CONTEXT)}
        self.lists: dict[str, list[np.ndarray | None]] = {name: [] for name, _ in _LISTS}
        self.rows = 0
        self.tokens = 0

    def full(self) -> bool:
        return self.rows >= ROW_GROUP_ROWS or self.tokens >= ROW_GROUP_TOKENS

    def add(self, covered: Covered) -> None:
        """The rows of one record: one per sample, or one with the sample columns null."""
        record, d, m = covered.record, covered.disposition, covered.manifest
        g = record.group
        trainer = None if m is None else m.policy_version
        shared: dict[str, Any] = {
            "step": None if m is None else m.step, "disposition": None if d is None else d.kind,
            "reason": None if d is None else d.reason, "trainer_version": trainer, "partition": record.partition,
            "offset": record.offset, "timestamp_ms": record.timestamp_ms,
            "step_created_at_ms": None if m is None else m.created_at_ms,
            "attempt": d.attempt if g is None and d is not None else None, "error": record.error,
        }
        if g is not None:
            shared.update(group_id=g.group_id, prompt_id=g.prompt_id, epoch=g.epoch, attempt=g.attempt,
                          producer_id=g.producer_id, policy_run=g.policy_run, prompt=g.prompt, status=g.status,
                          error=g.error, started_at_ms=g.started_at_ms, finished_at_ms=g.finished_at_ms,
                          metadata=json.dumps(dict(g.metadata)) if g.metadata else None)
        samples = () if g is None else g.samples.items()
        rows = max(1, len(samples))
        for name in _SHARED:  # one value per record, repeated on each of its rows
            self.columns[name].extend([shared.get(name)] * rows)
        if not samples:
            for name in _PER_SAMPLE:
                self.columns[name].append(None)
            for lists in self.lists.values():
                lists.append(None)
            self.rows += 1
            return
        c = self.columns
        advantages = [] if g is None else group_advantages(g)
        for j, (sample, advantage) in enumerate(zip(samples, advantages, strict=True)):
            version = sample.weight_version
            c["sample_index"].append(j)
            c["text"].append(sample.text)
            c["reward"].append(sample.reward)
            c["advantage"].append(advantage)
            c["finish_reason"].append(sample.finish_reason)
            c["weight_version"].append(version)
            c["staleness"].append(None if version is None or trainer is None else trainer - version)
            c["resumed"].append(bool(sample.resume_points))
            c["resumed_from"].append(list(sample.resumed_from))
            self.lists["tokens"].append(sample.tokens)
            self.lists["logprobs"].append(sample.logprobs)
            self.lists["loss_mask"].append(_mask_of(sample.loss_mask, len(sample.tokens)))
            self.lists["token_versions"].append(sample.token_versions())
            self.lists["resume_points"].append(np.asarray(sample.resume_points, np.int32) if sample.resume_points
                                               else _NOT_RESUMED)
            self.tokens += len(sample.tokens)
        self.rows += len(samples)

    def table(self, pa: Any, out_schema: pa.Schema) -> pa.Table:
        data = {name: pa.array(values, type=out_schema.field(name).type) for name, values in self.columns.items()}
        for name, dtype in _LISTS:
            data[name] = _list_array(pa, self.lists[name], dtype)
        return pa.table({name: data[name] for name in COLUMNS}, schema=out_schema)


def _mask_of(mask: np.ndarray | None, length: int) -> np.ndarray:
    """The sample's loss mask, or all ones (what `to_tensors` trains on) when it has none."""
    if mask is not None:
        return mask
    return _ONES[:length] if length <= len(_ONES) else np.ones(length, np.int8)


def group_advantages(group: ScoredGroup) -> list[float | None]:
    """Each sample's advantage as `Batch.to_tensors` computes it (`grpo_advantages`); all None when a
    sample has no reward (none for a group without samples)."""
    rewards = group.rewards
    if not rewards or any(r is None for r in rewards):
        return [None] * len(rewards)
    return list(grpo_advantages([r for r in rewards if r is not None]))


def _list_array(pa: Any, arrays: list[np.ndarray | None], dtype: str) -> pa.Array:
    """One list column from per-row arrays (None: a null list), built from one joined buffer."""
    lengths = np.fromiter((0 if a is None else len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    present = [a for a in arrays if a is not None]
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype)
    mask = pa.array([a is None for a in arrays], type=pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), type=pa.list_(getattr(pa, dtype)()),
                                    mask=mask)



def export_steps(config: KafkaConfig, namespace: str, consumer_group: str, first: int | None, last: int | None,
                 path: Path, *, timeout: float = 30.0, progress: Progress | None = None) -> ExportSummary:
    """Every offset the group's steps ``first..last`` (inclusive; None: open end) covered, one row per
    sample, to the Parquet file `path`. Reads as `replay --step` does (the manifests that count, then the
    steps' offset ranges under the trainer's group id, never joined, never committed), a chunk of steps at a
    time. Blocks until written; memory bounded (see the module docstring).

    Raises:
        RollstreamError: pyarrow missing; no step in the range; an offset a step covered is gone (retention)
            or holds another group (topic recreated). KafkaIOError: a read failed or made no progress for
            `timeout` s. OSError: `path` cannot be written.
    """
    require_pyarrow()
    manifests = steps_between(config, namespace, consumer_group, first, last, timeout=timeout)
    return write_steps(read_steps(config, manifests, timeout=timeout, progress=progress), path)


def export_range(config: KafkaConfig, namespace: str, consumer_group: str, bounds: Mapping[int, tuple[int, int]],
                 path: Path, *, timeout: float = 30.0, progress: Progress | None = None) -> ExportSummary:
    """Every record of NS.rollouts in `bounds` ([start, end) per partition, as `replay_range`), one row per
    sample, with the step of `consumer_group` that covered it (`step` and `disposition` null where none has
    yet). Blocks until written; raises as `export_steps`."""
    require_pyarrow()
    return write_records(read_range(config, namespace, consumer_group, bounds, timeout=timeout, progress=progress),
                         path)
