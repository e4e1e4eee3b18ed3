"""The demo's record of a run: what the trainer took at one step (to compare with its replay), and the result.

`fingerprint` keeps, for one step, the group ids, their positions, a digest of the record bytes and a
digest of the tensors the trainer trained on; `replay_matches` rebuilds that step from its manifest with
`rollstream.consumers.replay_step` and compares all four. `DemoResult` is what `run_demo` returns and
`write_summary` stores as ``summary.json``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollstream.consumers import Batch, replay_step
from rollstream.demo._display import StepRow, window_mean
from rollstream.demo._services import ProducerExit
from rollstream.infra import KafkaConfig
from rollstream.schemas import encode


@dataclass(frozen=True)
class DemoResult:
    """What a demo run did and found; `ok` when every check passed. `engine` generated (``hf`` or ``vllm``),
    `engine_label` says how, in words."""

    rows: tuple[StepRow, ...]
    engine: str
    engine_label: str
    namespace: str
    group_id: str
    bootstrap: str
    wall_s: float
    train_s: float
    window: int
    replay_step: int
    replay_ok: bool
    replay_message: str
    audit_ok: bool
    audit_message: str
    audit_counts: Mapping[str, int]
    producers: tuple[ProducerExit, ...]
    plot_path: Path
    steps_path: Path
    summary_path: Path
    problems: tuple[str, ...] = field(default=())
    report_path: Path | None = None  # the HTML report of every step (None: not written, see problems)
    export_path: Path | None = None  # every step as Parquet (None: not written, see problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def groups(self) -> int:
        return sum(r.groups for r in self.rows)

    @property
    def steps_per_s(self) -> float:
        return len(self.rows) / self.train_s if self.train_s > 0 else 0.0

    @property
    def groups_per_s(self) -> float:
        """Groups taken per second of training (from the first take to the last commit)."""
        return self.groups / self.train_s if self.train_s > 0 else 0.0

    @property
    def producer_logs(self) -> list[Path]:
        return [p.log_path for p in self.producers]

    def _mean(self, attr: str, last: bool) -> float:
        values = [getattr(r, attr) for r in self.rows]
        return window_mean(values[-self.window:] if last else values[: self.window], self.window)

    @property
    def reward_start(self) -> float:
        return self._mean("reward", last=False)

    @property
    def reward_end(self) -> float:
        return self._mean("reward", last=True)

    @property
    def exact_start(self) -> float:
        return self._mean("exact", last=False)

    @property
    def exact_end(self) -> float:
        return self._mean("exact", last=True)


@dataclass(frozen=True)
class TakenStep:
    """What the trainer took at one step, to compare with its replay: ids, positions, bytes, tensors."""

    step: int
    group_ids: tuple[str, ...]
    positions: tuple[tuple[int, int], ...]
    bytes_sha256: str
    tensors_sha256: str


def fingerprint(batch: Batch, tensors: Any) -> TakenStep:
    """What to compare the replay of `batch.step` with (`tensors`: the batch's `TensorBatch`)."""
    return TakenStep(batch.step, tuple(batch.group_ids), tuple(batch.positions),
                     sha256_of(encode(g) for g in batch.groups), tensors_sha256(tensors))


def sha256_of(chunks: Iterable[bytes]) -> str:
    """One digest of a sequence of byte strings (each length-prefixed, so boundaries count)."""
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(len(chunk).to_bytes(8, "little"))
        h.update(chunk)
    return h.hexdigest()


def tensors_sha256(tensors: Any) -> str:
    """A digest of the tensors a trainer step uses (ids, masks, advantages, rollout logprobs)."""
    names = ("input_ids", "attention_mask", "loss_mask", "advantages", "rollout_logprobs")
    return sha256_of([getattr(tensors, n).detach().cpu().contiguous().numpy().tobytes() for n in names])


def replay_matches(config: KafkaConfig, namespace: str, group_id: str, taken: TakenStep | None, *,
                   pad_id: int) -> tuple[bool, str]:
    """Replay `taken.step` from its manifest; compare ids, positions, record bytes and tensors. Blocks.

    Raises:
        RollstreamError: the step cannot be replayed (no manifest, records deleted).
    """
    if taken is None:
        return False, "no step was remembered for replay"
    replayed = replay_step(config, namespace, group_id, taken.step)
    checks = {
        "group ids": tuple(r.group.group_id if r.group else "" for r in replayed.records) == taken.group_ids,
        "positions": tuple((r.partition, r.offset) for r in replayed.records) == taken.positions,
        "record bytes": sha256_of(r.value for r in replayed.records) == taken.bytes_sha256,
        "tensors": tensors_sha256(replayed.to_batch().to_tensors(pad_id=pad_id)) == taken.tensors_sha256,
    }
    failed = [name for name, same in checks.items() if not same]
    if failed:
        return False, f"MISMATCH in {', '.join(failed)} ({len(replayed.records)} groups replayed)"
    return True, f"identical to what the trainer took ({len(taken.group_ids)} groups: ids, offsets, bytes, tensors)"


def write_summary(result: DemoResult) -> None:
    """Write `result` as JSON to its ``summary_path`` (everything a script or test needs to check a run)."""
    summary = {
        "ok": result.ok, "problems": list(result.problems), "engine": result.engine,
        "engine_label": result.engine_label, "namespace": result.namespace,
        "group_id": result.group_id, "bootstrap": result.bootstrap, "steps": len(result.rows),
        "groups": result.groups, "wall_s": round(result.wall_s, 3), "train_s": round(result.train_s, 3),
        "steps_per_s": round(result.steps_per_s, 4), "groups_per_s": round(result.groups_per_s, 3),
        "window": result.window,
        "reward_start": result.reward_start, "reward_end": result.reward_end,
        "exact_start": result.exact_start, "exact_end": result.exact_end,
        "replay": {"step": result.replay_step, "ok": result.replay_ok, "message": result.replay_message},
        "audit": {"ok": result.audit_ok, "summary": result.audit_message, "counts": dict(result.audit_counts)},
        "producers": [{**asdict(p), "log_path": str(p.log_path)} for p in result.producers],
        "plot": str(result.plot_path), "steps_file": str(result.steps_path),
        "report": None if result.report_path is None else str(result.report_path),
        "export": None if result.export_path is None else str(result.export_path),
    }
    result.summary_path.write_text(json.dumps(summary, indent=2) + "\n")


def summary_lines(result: DemoResult) -> list[str]:
    """The closing summary of a `DemoResult`, one line per fact."""
    lines = [
        f"rollstream demo {'passed' if result.ok else 'FAILED'}: {len(result.rows)} steps, {result.groups} groups, "
        f"{result.wall_s:.0f} s ({result.train_s:.0f} s training, {result.steps_per_s:.2f} steps/s, "
        f"{result.groups_per_s:.1f} groups/s)",
        f"generated by: {result.engine_label}",
        f"mean reward: {result.reward_start:.3f} (first {result.window} steps) -> {result.reward_end:.3f} "
        f"(last {result.window} steps); exact match {result.exact_start:.3f} -> {result.exact_end:.3f}",
        f"replay of step {result.replay_step}: {result.replay_message}",
        f"audit: {result.audit_message}",
        f"plot: {result.plot_path}",
        f"report (open in a browser): {result.report_path or 'not written'}",
        f"every step as Parquet: {result.export_path or 'not written'}",
        f"steps: {result.steps_path}",
        f"producer logs: {', '.join(str(p) for p in result.producer_logs)}",
        f"namespace {result.namespace}, trainer group {result.group_id}, broker {result.bootstrap}",
    ]
    lines.extend(f"problem: {p}" for p in result.problems)
    return lines
