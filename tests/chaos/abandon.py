"""``python -m tests.chaos.abandon``: calls cut off by a frozen broker, in a loop, to find what aborts a trainer.

Issue 36: trainers died of ``rdkafka_queue.h:1086: rd_kafka_enq_once_del_source_return: Assertion
'eonce->refcnt > 0' failed`` (SIGABRT) under a broker nemesis. Each ``--level`` drives one suspect sequence
on purpose, round after round, against a private broker frozen (SIGSTOP) for ``--pause`` s per round:

- ``status`` (default): the cluster read of a timed-out take (`rollstream.consumers.forensics.status` of
  producers and prompts, bounded by ``--timeout`` in one kept thread, as `TimeoutDiagnoser` reads it). Its
  producers part describes the producers' group, a request routed to the group coordinator; its
  ``request_timeout`` passes while the broker is frozen, and when the broker answers late librdkafka 2.16
  asserts (librdkafka#4605, #3663). It aborted every worker in the first round until that read moved to a child
  process (`rollstream.infra.group_members`); now it must pass.
- ``admin``: only that: an `AdminClient`'s ``describe_consumer_groups`` timed out by a freeze, the client kept
  until the broker is continued. The minimal reproduction, without rollstream.
- ``consumer``: `RolloutConsumer` take (``commit=False``), then a commit cut off by the freeze: attempts run out,
  the client is replaced after two and the old one closed (the first suspect, when a synchronous commit was
  run in a thread and abandoned at its timeout; commits are asynchronous now, `rollstream.infra.commits`).

Each worker is a process of its own (``--worker``, started by the supervisor): a worker that dies of a signal
(SIGABRT, SIGSEGV) or with a traceback is counted with its output's tail, the broker is continued, and a new
worker goes on until ``--rounds`` rounds or ``--seconds`` have passed. Exit status 1 if any worker died. A
regression check kept out of ``make test`` (a broker start and seconds of freeze per round):
``python -m tests.chaos.abandon --level status --rounds 10 --seconds 120``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
from rollstream.consumers import CommitError, RolloutConsumer
from rollstream.consumers.forensics import status
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import BrokerSpec, free_port
from rollstream.infra.clients import open_admin
from rollstream.infra.kafka_errors import CommitFailed
from rollstream.infra.threads import BoundedCaller

from tests.chaos._cluster import Cluster
from tests.integration._kafka import REPO_ROOT
from tests.records import publish_many

GROUP = "abandon-trainer"
PARTITIONS = 1
STEP_N = 2  # groups per step: a round takes one step
GROUPS = 2000  # published once: enough steps for every round of a long run
ROUND_DONE = "round done"  # a worker's progress line, counted by the supervisor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.abandon", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", choices=("status", "admin", "consumer"), default="status",
                        help="status: the cluster read of a waiting or timed-out take (describe_consumer_groups); "
                             "admin: that admin request alone; consumer: RolloutConsumer take/commit and client "
                             "replacement (default status)")
    parser.add_argument("--rounds", type=int, default=40, help="rounds in all, over every worker (default 40)")
    parser.add_argument("--seconds", type=float, default=300.0, help="stop after this long (default 300)")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="the consumer's timeout in seconds (default 2)")
    parser.add_argument("--pause", type=float, default=4.0,
                        help="seconds the broker is frozen per round; with --jitter, at most (default 4)")
    parser.add_argument("--jitter", action="store_true",
                        help="each round's freeze drawn uniformly from [pause/4, pause] (seeded by --seed), so that "
                             "late answers race the deadlines")
    parser.add_argument("--seed", type=int, default=1, help="seed of the --jitter draws (default 1)")
    parser.add_argument("--worker", nargs=2, metavar=("BOOTSTRAP", "BROKER_PID"), help=argparse.SUPPRESS)
    parser.add_argument("--namespace", default="abandon", help=argparse.SUPPRESS)
    parser.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- the worker: one process, rounds until it is stopped or dies ----------------------------------------------


def _freeze(pid: int, args: argparse.Namespace, rng: random.Random) -> float:
    """SIGSTOP the broker; returns when to continue it (`args.pause` s on, or a draw with --jitter)."""
    pause_s = rng.uniform(args.pause / 4, args.pause) if args.jitter else args.pause
    os.kill(pid, signal.SIGSTOP)
    return time.monotonic() + pause_s


def _thaw(pid: int, until: float) -> None:
    time.sleep(max(0.0, until - time.monotonic()))
    os.kill(pid, signal.SIGCONT)


def consumer_rounds(config: KafkaConfig, namespace: str, broker_pid: int, args: argparse.Namespace,
                    rng: random.Random) -> None:
    """Rounds of take (commit=False), freeze, commit that runs out (client replaced), thaw, commit."""
    with RolloutConsumer(config=config, group_id=GROUP, namespace=namespace, timeout=args.timeout,
                         filters=()) as consumer:
        for i in range(1, 10**9):
            batch = consumer.take(STEP_N, timeout=60.0, commit=False)
            until = _freeze(broker_pid, args, rng)
            try:
                consumer.commit(batch)
                outcome = "committed during the freeze"
            except CommitError as exc:
                outcome = f"cut off ({str(exc)[:80]})"
            _thaw(broker_pid, until)
            _commit_when_up(lambda b=batch: consumer.commit(b))
            replaced = consumer.metrics.client_replacements._value.get()  # noqa: SLF001 - a count for the log
            print(f"{ROUND_DONE} {i}: step {batch.step} {outcome}; clients replaced so far: {replaced:g}", flush=True)


def status_rounds(config: KafkaConfig, namespace: str, broker_pid: int, args: argparse.Namespace,
                  rng: random.Random) -> None:
    """Rounds of freeze, the cluster read of a timed-out take (`status`, producers and prompts, bounded by the
    timeout in one kept thread, as `TimeoutDiagnoser` reads it), thaw, the same read with the broker up."""
    caller = BoundedCaller("rollstream-status")
    for i in range(1, 10**9):
        until = _freeze(broker_pid, args, rng)
        frozen = status(config, namespace, parts=("producers", "prompts"), timeout=args.timeout, caller=caller)
        print(f"round {i}: the read during the freeze returned (unavailable {sorted(frozen.unavailable)}); "
              f"continuing the broker in {max(0.0, until - time.monotonic()):.1f} s", flush=True)
        _thaw(broker_pid, until)
        print(f"round {i}: broker continued", flush=True)
        up = status(config, namespace, parts=("producers", "prompts"), timeout=10.0, caller=caller)
        print(f"{ROUND_DONE} {i}: with the broker up, unavailable {sorted(up.unavailable)}", flush=True)


def admin_rounds(config: KafkaConfig, namespace: str, broker_pid: int, args: argparse.Namespace,
                 rng: random.Random) -> None:
    """Rounds of freeze, ``describe_consumer_groups`` timed out (the client kept), thaw, the same with the broker up."""
    admin = open_admin(config.admin())
    group = TopicNames(namespace).producer_group
    for i in range(1, 10**9):
        until = _freeze(broker_pid, args, rng)
        try:
            admin.describe_consumer_groups([group], request_timeout=args.timeout)[group].result(args.timeout + 1.0)
            outcome = "answered during the freeze"
        except KafkaException as exc:
            outcome = f"timed out ({exc.args[0].name()})"
        print(f"round {i}: describe_consumer_groups during the freeze: {outcome}", flush=True)
        _thaw(broker_pid, until)
        print(f"round {i}: broker continued", flush=True)
        admin.describe_consumer_groups([group], request_timeout=10.0)[group].result(11.0)
        print(f"{ROUND_DONE} {i}: {outcome}", flush=True)


def _commit_when_up(commit: object, tries: int = 20) -> None:
    """Retry `commit` (a callable) until it succeeds with the broker up; the last failure propagates."""
    for attempt in range(tries):
        try:
            commit()  # type: ignore[operator]
            return
        except (CommitError, CommitFailed):
            if attempt == tries - 1:
                raise
            time.sleep(0.5)


def worker(args: argparse.Namespace) -> None:
    bootstrap, pid = args.worker[0], int(args.worker[1])
    config = KafkaConfig.load(bootstrap, client_id="abandon-worker")
    levels = {"status": status_rounds, "admin": admin_rounds, "consumer": consumer_rounds}
    levels[args.level](config, args.namespace, pid, args, random.Random(args.seed * 1000 + args.worker_index))


# -- the supervisor -----------------------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the workers did: rounds completed, and each worker death that was not the supervisor's stop."""

    rounds: int = 0
    workers: int = 0
    deaths: list[str] = field(default_factory=list)


def _worker_command(args: argparse.Namespace, bootstrap: str, broker_pid: int, index: int) -> list[str]:
    return [sys.executable, "-m", "tests.chaos.abandon", "--worker", bootstrap, str(broker_pid), "--level",
            args.level, "--timeout", str(args.timeout), "--pause", str(args.pause), "--namespace", args.namespace,
            "--seed", str(args.seed), "--worker-index", str(index)] + ["--jitter"] * args.jitter


def supervise(args: argparse.Namespace, cluster: Cluster, bootstrap: str, logs: Path) -> Tally:
    """Run workers one after another until `args.rounds` rounds are done or `args.seconds` pass."""
    tally = Tally()
    end = time.monotonic() + args.seconds
    broker_pid = cluster.pid(1)
    while tally.rounds < args.rounds and time.monotonic() < end:
        tally.workers += 1
        log_path = logs / f"worker-{tally.workers}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(_worker_command(args, bootstrap, broker_pid, tally.workers), cwd=REPO_ROOT,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
            code = _watch(proc, log_path, tally, args.rounds, end)
        cluster.resume(1)  # a worker that died between SIGSTOP and SIGCONT left the broker frozen
        text = log_path.read_text(errors="replace")
        if code is not None and (code < 0 or "Traceback" in text):
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"rc {code}"
            tail = "\n".join(text.splitlines()[-12:])
            tally.deaths.append(f"worker {tally.workers} ({log_path}) died: {how} after "
                                f"{text.count(ROUND_DONE)} rounds:\n{tail}")
            print(f"worker {tally.workers} DIED ({how}):\n{tail}", flush=True)
    return tally


def _watch(proc: subprocess.Popen[bytes], log_path: Path, tally: Tally, rounds: int, end: float) -> int | None:
    """Wait for the worker to die or for enough rounds; its return code if it ended on its own, else None."""
    seen = 0
    while proc.poll() is None:
        seen = _count_rounds(log_path, seen, tally)
        if tally.rounds >= rounds or time.monotonic() >= end:
            proc.kill()
            proc.wait()
            return None
        time.sleep(0.2)
    _count_rounds(log_path, seen, tally)
    return proc.returncode


def _count_rounds(log_path: Path, seen: int, tally: Tally) -> int:
    """Count (and echo) the rounds the worker finished since the `seen` first; returns how many it finished."""
    done = [line for line in log_path.read_text(errors="replace").splitlines() if line.startswith(ROUND_DONE)]
    for line in done[seen:]:
        print(f"worker {tally.workers}: {line}", flush=True)
    tally.rounds += len(done) - seen
    return len(done)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    run_dir = Path(tempfile.mkdtemp(prefix="abandon-", dir="/tmp"))
    cluster = Cluster(BrokerSpec(port=free_port(1), nodes=1, data_dir=run_dir / "broker", heap_mb=512))
    started = time.monotonic()
    try:
        bootstrap = cluster.start()
        config = KafkaConfig.load(bootstrap)
        names = TopicNames(args.namespace)
        create_topics(TopicPlan(names=names, partitions=PARTITIONS), config)
        if args.level == "consumer":
            publish_many(config, names, GROUPS)
        print(f"broker up on {bootstrap}; {args.level} rounds: timeout {args.timeout:g} s, broker frozen "
              f"{'up to ' if args.jitter else ''}{args.pause:g} s per round", flush=True)
        (run_dir / "logs").mkdir()
        tally = supervise(args, cluster, bootstrap, run_dir / "logs")
    finally:
        cluster.stop()
    ok = not tally.deaths
    print(f"abandon {'PASS' if ok else 'FAIL'}: {tally.rounds} rounds, {tally.workers} worker(s), "
          f"{len(tally.deaths)} died, {time.monotonic() - started:.0f} s (level {args.level}, timeout "
          f"{args.timeout:g} s, pause {args.pause:g} s)", flush=True)
    for death in tally.deaths:
        print(death, flush=True)
    if ok:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"logs kept in {run_dir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
