"""The moving parts of one fleet phase in the driver: worker processes, the trainer, the prompt loader, the
lag sampler. Each runs in a named thread (or a child process) and is stopped with an Event or a line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import OffsetSpec
from rollstream.consumers import RolloutConsumer, audit, commit_until_committed
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra._replaceable import ClientReplacement
from rollstream.infra.clients import open_admin, open_producer
from rollstream.infra.kafka_io import produce_and_wait
from rollstream.schemas import Prompt, RollstreamError, encode

from tests.chaos._check import loaded_group_ids
from tests.integration._kafka import REPO_ROOT, cli_env


class WorkerProc:
    """One ``tests.fleet._worker`` child: its JSON lines are read by a thread into `ticks` / `final`."""

    def __init__(self, spec: dict[str, Any], log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.ticks: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fleet._worker", json.dumps(spec)], cwd=REPO_ROOT,
                                     env=cli_env(spec["bootstrap"]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True)
        self._reader = threading.Thread(target=self._read, name=f"fleet-read-{spec['proc']}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None  # noqa: S101 - Popen(stdout=PIPE) always has one
        for line in self.proc.stdout:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("kind") == "final":
                self.final = row
            else:
                self.ticks.append(row)

    @property
    def latest(self) -> dict[str, Any]:
        return self.ticks[-1] if self.ticks else {}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask_stop(self) -> None:
        try:
            assert self.proc.stdin is not None  # noqa: S101
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def wait(self, timeout_s: float) -> int | None:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = None
        self._reader.join(5.0)
        self._log.close()
        return code

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class TrainerFacts:
    steps: list[tuple[float, int, int]] = field(default_factory=list)  # (time, groups taken, filtered)
    taken: Counter[str] = field(default_factory=Counter)  # group id -> times taken
    filtered: dict[str, str] = field(default_factory=dict)  # group id -> reason
    duplicate_skips: int = 0
    retries: list[str] = field(default_factory=list)  # retriable failures of a take or a commit, tried again
    committed: int = 0  # sum over partitions of the offsets committed so far
    commits: int = 0  # odd while a commit is under way: a lag sample across one is dropped (`LagSampler`)
    error: str | None = None

    @property
    def taken_total(self) -> int:
        return sum(n for _, n, _ in self.steps)


class Trainer:
    """`RolloutConsumer.take(n)` with a modelled step time, then `commit` (thread ``fleet-trainer``).

    `finish(expected)`: once the producers are done, take what is left of `expected` groups (a last,
    smaller step) and stop; a remainder that never comes within `settle_s` is left (and found lost).
    """

    def __init__(self, config: KafkaConfig, namespace: str, group: str, *, take_n: int, step_s: float) -> None:
        self.config, self.namespace, self.group = config, namespace, group
        self.take_n, self.step_s = take_n, step_s
        self.facts = TrainerFacts()
        self._stop = threading.Event()
        self._expected: int | None = None
        self._settle_s = 30.0
        self._finish_at = 0.0
        self._thread = threading.Thread(target=self._run, name="fleet-trainer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def finish(self, expected: int, settle_s: float = 30.0) -> None:
        self._settle_s = settle_s
        self._finish_at = time.monotonic()  # the settle time counts from here, not from a stall before it
        self._expected = expected
        self._thread.join(settle_s + 60.0)
        self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30.0)

    def _accounted(self) -> int:
        return len(self.facts.taken) + len(self.facts.filtered)

    def _run(self) -> None:
        try:
            with RolloutConsumer(config=self.config, group_id=self.group, namespace=self.namespace,
                                 timeout=60.0) as consumer:
                self._loop(consumer)
        except Exception as exc:  # noqa: BLE001 - reported as the phase's error
            self.facts.error = f"trainer: {type(exc).__name__}: {exc}"

    def _loop(self, consumer: RolloutConsumer) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            n = self.take_n
            if self._expected is not None:
                left = self._expected - self._accounted()
                if left <= 0 or time.monotonic() - max(idle_since, self._finish_at) > self._settle_s:
                    return
                n = min(n, left)
            try:
                batch = consumer.poll_batch(n, 0.5, commit=False)  # None: not there yet (no error, no cluster read)
            except RollstreamError as exc:  # a broker node down (--churn): as a training loop would, try again
                if not exc.retriable:
                    raise
                self.facts.retries.append(f"take: {type(exc).__name__}: {str(exc)[:200]}")
                time.sleep(0.5)
                continue
            if batch is None:
                continue
            idle_since = time.monotonic()
            time.sleep(self.step_s)  # the modelled optimizer step, between take and commit as a real trainer
            self.facts.commits += 1
            commit_until_committed(consumer.commit, batch, lambda exc: self.facts.retries.append(
                f"commit: {type(exc).__name__}: {str(exc)[:200]}"))
            self.facts.committed = sum(batch.offsets.values())
            self.facts.commits += 1
            self._record(batch)

    def _record(self, batch: Any) -> None:
        filtered = 0
        for d in batch.dispositions:
            if d.kind == "filtered" and d.group_id is not None:
                self.facts.filtered[d.group_id] = d.reason or "?"
                filtered += 1
            elif d.kind == "duplicate":
                self.facts.duplicate_skips += 1
        self.facts.taken.update(batch.group_ids)
        self.facts.steps.append((time.time(), len(batch.groups), filtered))


class Loader:
    """Keeps `backlog` prompts on NS.prompts that no producer has turned into a group yet (thread
    ``fleet-loader``), in waves of fresh ids, so producers wait on backpressure, never on prompts."""

    def __init__(self, config: KafkaConfig, names: TopicNames, prefix: str, *, backlog: int,
                 produced: Callable[[], int]) -> None:
        self.config, self.names, self.prefix, self.backlog = config, names, prefix, backlog
        self._produced = produced  # () -> groups on NS.rollouts so far
        self.loaded = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._producer: Producer = open_producer(config.producer({"linger.ms": 20}))
        self._thread = threading.Thread(target=self._run, name="fleet-loader", daemon=True)

    def load(self, count: int) -> None:
        first = self.loaded
        records = ((f"{self.prefix}-{i:07d}".encode(),
                    encode(Prompt(id=f"{self.prefix}-{i:07d}", prompt=f"question {i}", label=str(i % 10))))
                   for i in range(first, first + count))
        produce_and_wait(self._producer, self.names.prompts, records, timeout=60.0)
        self.loaded += count

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(70.0)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            short = self.backlog - (self.loaded - self._produced())
            if short >= self.backlog // 4:
                try:
                    self.load(short)
                except Exception as exc:  # noqa: BLE001 - stop loading; the phase reports it
                    self.error = f"loader: {type(exc).__name__}: {exc}"
                    return


class LagSampler:
    """The trainer group's committed lag every `interval_s` (thread ``fleet-lag-sampler``): the sum of the
    rollouts topic's end offsets (one admin ListOffsets per partition leader, so a sample costs 3 requests
    whatever the partition count) minus the sum of the offsets the trainer committed (it knows them:
    `Trainer.committed`), only from reads during which no commit was under way (`commits` even and unchanged).
    The driver's own reads, not counted as backpressure."""

    def __init__(self, config: KafkaConfig, topic: str, partitions: int, committed: Callable[[], int], *,
                 interval_s: float = 0.1, commits: Callable[[], int] = lambda: 0) -> None:
        self.topic, self.interval_s, self._committed, self._commits = topic, interval_s, committed, commits
        self._query = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}
        self._admin = open_admin(config.admin())
        # a client whose metadata went stale (a node killed: FENCED_LEADER_EPOCH over and over) starts afresh
        self._replacement = ClientReplacement("fleet-lag-admin", open_client=lambda: open_admin(config.admin()),
                                              swap=self._swap, close_client=lambda _: None, after_failures=3)
        self.samples: list[tuple[float, int]] = []
        self.ends = 0  # records on the rollouts topic at the last sample
        self.error: str | None = None
        self.failed = 0  # reads that failed (a node down: its partitions' leaders move)
        self._ends: dict[int, int] = {}  # partition -> the highest end offset read
        self.across: list[tuple[float, int]] = []  # reads during a commit: the lag against the offsets before it
        self.failed_at: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-lag-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15.0)

    def _swap(self, new: Any) -> Any:
        old, self._admin = self._admin, new
        return old

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            commits = self._commits()
            committed = self._committed()  # read first: a commit racing the read can only make the lag look larger
            try:
                futures = self._admin.list_offsets(self._query, request_timeout=5.0)
                for tp, f in futures.items():
                    # Never below an end seen before: a leader just elected (a node killed, --churn) may answer
                    # with a high watermark its followers have not confirmed yet, lower than the one before.
                    self._ends[tp.partition] = max(self._ends.get(tp.partition, 0), f.result(timeout=10.0).offset)
                ends = sum(self._ends.values())
            except Exception as exc:  # noqa: BLE001 - a missed sample is a gap in the plot; many in a row an error
                self.failed += 1
                self.failed_at.append(time.time())
                self._replacement.failed(exc)
                if self._replacement.failures >= 20:
                    self.error = (f"lag sampler: {self._replacement.failures} failed reads in a row, last "
                                  f"{type(exc).__name__}: {exc}")
                continue
            self._replacement.succeeded()
            self.ends = ends
            if commits % 2 == 0 and self._commits() == commits:  # else it would count, against the offsets before
                self.samples.append((time.time(), ends - committed))  # a commit, what producers published after it
            else:  # kept apart: at most one step too high, and the only figure while a commit hangs (a node down)
                self.across.append((time.time(), ends - committed))


def verdict(config: KafkaConfig, names: TopicNames, group: str, facts: TrainerFacts, loader: Loader,
            workers: list[WorkerProc]) -> dict[str, Any]:
    """Every prompt on NS.prompts (read back: `tests.chaos._check.loaded_group_ids`) taken or filtered
    exactly once by group id, nothing taken that was not loaded, `rollstream.consumers.audit` green, no errors."""
    loaded = loaded_group_ids(config, names)
    taken = set(facts.taken)
    lost = sorted(loaded - taken - set(facts.filtered))
    duplicated = sorted([g for g, c in facts.taken.items() if c > 1] + sorted(taken & set(facts.filtered)))
    unexpected = sorted(taken - loaded)
    report = audit(config, names.namespace, group, timeout=60.0)
    errors = [e for e in (facts.error, loader.error) if e]
    errors += [e for w in workers for e in (w.final or {}).get("errors", [])]
    missing_final = [w.spec["proc"] for w in workers if w.final is None]
    if missing_final:
        errors.append(f"producer processes {missing_final} did not stop cleanly")
    return {"loaded": len(loaded), "loader_count": loader.loaded, "taken": facts.taken_total,
            "filtered": len(facts.filtered), "duplicates_skipped_by_trainer": facts.duplicate_skips,
            "trainer_retries": len(facts.retries), "trainer_retried": facts.retries[:5],
            "lost": len(lost), "lost_ids": lost[:10], "duplicated": len(duplicated), "duplicated_ids": duplicated[:10],
            "unexpected": len(unexpected), "audit_ok": report.ok, "audit": report.summary(), "errors": errors,
            "ok": not (lost or duplicated or unexpected or errors) and report.ok}
