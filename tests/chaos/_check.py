"""The chaos run's verdict, read back from Kafka as a user would, after the drain.

- *Loaded*: every prompt record on NS.prompts (the truth, even where a load was refused or cut short by
  a fault), as expected group ids.
- *Taken / filtered*: the effective steps that `rollstream.consumers.audit` counts, each rebuilt with
  `rollstream.consumers.replay_step` (which also checks that every taken offset holds the group its manifest names).
- *Lost*: a loaded group neither taken nor filtered in any effective step.
- *Duplicated*: a group id taken in more than one place over all effective steps.
- The trainer's ``--out`` file agrees: the last copy of each step (a step re-taken after a kill repeats its
  number; only the last copy can be the committed one) holds the manifest's groups, in order.
- `rollstream.consumers.audit` is green.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rollstream.consumers import AuditReport, ReplayedStep, audit, replay_step
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.kafka_io import partitions_of, read_ranges, reader, watermarks
from rollstream.schemas import Prompt, decode


@dataclass
class Verdict:
    """What the checks found; `ok` when nothing was lost or duplicated, the audit is green and --out agrees."""

    loaded: int = 0
    steps: int = 0
    taken: int = 0
    filtered: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)  # duplicate / undecodable dispositions
    lost: list[str] = field(default_factory=list)
    duplicated: dict[str, list[int]] = field(default_factory=dict)  # group id -> the steps that took it
    unexpected: list[str] = field(default_factory=list)  # taken, but no such prompt was loaded
    out_mismatch: list[str] = field(default_factory=list)
    out_copies: int = 0  # step copies in --out beyond one per step (re-taken after a kill)
    torn_lines: int = 0
    audit_ok: bool = False
    audit_summary: str = ""

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.out_mismatch) and self.audit_ok


def loaded_group_ids(config: KafkaConfig, names: TopicNames, timeout_s: float = 60.0) -> set[str]:
    """The group id of every prompt record on NS.prompts now (all partitions, from the start)."""
    with reader(config, "chaos-prompt-reader") as consumer:
        partitions = partitions_of(consumer, names.prompts, timeout=timeout_s)
        bounds = {p: watermarks(consumer, names.prompts, p, timeout=timeout_s) for p in partitions}
    return {decode(msg.value() or b"", Prompt).group_id
            for msg in read_ranges(config, names.prompts, bounds, group_id="chaos-prompt-reader", timeout=timeout_s)}


def out_file_steps(path: Path) -> tuple[dict[int, list[str]], int, int]:
    """The last copy of each step in a `rollstream take --out` file, the number of earlier copies, and
    the number of torn lines (a run killed mid-write)."""
    copies: dict[int, list[list[str]]] = defaultdict(list)
    torn, previous = 0, None
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
            step, group_id = int(row["step"]), str(row["group_id"])
        except (ValueError, KeyError, TypeError):
            torn += 1
            previous = None
            continue
        # One step's lines are written together; a new run restarts the copy. A run that re-takes the step the
        # previous one wrote last (killed before its commit) writes the same step number again, right after it:
        # a group id repeating within the copy (a step never holds one twice) starts the new copy.
        if step != previous or group_id in copies[step][-1]:
            copies[step].append([])
        copies[step][-1].append(group_id)
        previous = step
    return ({s: c[-1] for s, c in copies.items()}, sum(len(c) - 1 for c in copies.values()), torn)


def taken_in_out_file(path: Path) -> set[str]:
    """Group ids in the last copy of each step of the --out file (what the trainer has taken so far)."""
    return {g for groups in out_file_steps(path)[0].values() for g in groups}


def check(config: KafkaConfig, names: TopicNames, group: str, out_path: Path, *, timeout_s: float = 60.0) -> Verdict:
    """Read everything back and judge it (see the module docstring). Blocks; a read error propagates."""
    verdict = Verdict()
    report: AuditReport = audit(config, names.namespace, group, timeout=timeout_s)
    verdict.audit_ok, verdict.audit_summary = report.ok, report.summary()
    expected = loaded_group_ids(config, names, timeout_s)
    verdict.loaded = len(expected)
    # Each replay reads the manifests and the step's range with clients of its own: safe in threads.
    with ThreadPoolExecutor(4, thread_name_prefix="chaos-replay") as pool:
        replayed: list[ReplayedStep] = list(pool.map(
            lambda s: replay_step(config, names.namespace, group, s, timeout=timeout_s), report.steps))
    verdict.steps = len(replayed)
    taken_at: dict[str, list[int]] = defaultdict(list)
    filtered: set[str] = set()
    for step in replayed:
        for d in step.manifest.dispositions:
            if d.kind == "taken" and d.group_id is not None:
                taken_at[d.group_id].append(step.manifest.step)
            elif d.kind == "filtered":
                verdict.filtered[d.reason or "no reason"] += 1
                if d.group_id is not None:
                    filtered.add(d.group_id)
            else:
                verdict.skipped[d.kind] += 1
    verdict.taken = sum(len(steps) for steps in taken_at.values())
    verdict.duplicated = {g: steps for g, steps in taken_at.items() if len(steps) > 1}
    verdict.lost = sorted(expected - set(taken_at) - filtered)
    verdict.unexpected = sorted(set(taken_at) - expected)
    _compare_out_file(verdict, replayed, out_path)
    return verdict


def _compare_out_file(verdict: Verdict, replayed: list[ReplayedStep], out_path: Path) -> None:
    last, verdict.out_copies, verdict.torn_lines = out_file_steps(out_path)
    for step in replayed:
        number = step.manifest.step
        want = [r.group.group_id for r in step.records if r.group is not None]
        got = last.get(number)
        if got is None:
            verdict.out_mismatch.append(f"step {number}: committed, but not in {out_path}")
        elif got != want:
            verdict.out_mismatch.append(f"step {number}: {out_path} has {len(got)} group(s) {got[:3]}..., the "
                                        f"manifest {len(want)} {want[:3]}...")
    committed = {s.manifest.step for s in replayed}
    beyond = sorted(set(last) - committed)
    if beyond:
        verdict.out_mismatch.append(f"steps {beyond} are in {out_path} but were never committed")
