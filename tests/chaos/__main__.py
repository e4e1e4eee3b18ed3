"""``make chaos``: ``python -m tests.chaos [--seed S ...] [--seconds N] [--nodes 1|3]`` (see `tests.chaos`)."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rollstream.consumers import audit
from rollstream.infra import KafkaConfig, LagReader, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import BrokerSpec, free_port
from rollstream.producers.prompts import load_prompts

from tests.chaos._check import Verdict, check, loaded_group_ids, taken_in_out_file
from tests.chaos._cluster import Cluster
from tests.chaos._nemesis import Nemesis
from tests.chaos._procs import GEN_DELAY_S, Role, loop_trainer_role, producer_role, trainer_role
from tests.chaos._report import RunFacts, render
from tests.chaos._rss import RssSampler

GROUP = "chaos-trainer"
PRODUCERS = 2
PARTITIONS = 4
FAULT_GAP_S = (2.0, 8.0)  # seconds between two faults, drawn uniformly
WAVE_EVERY_S = 2.0  # a wave of --take-n prompts is loaded this often during the nemesis
SETTLE_S = 10.0  # drain: the trainer counts as done once nothing moved for this long
DEFAULT_SEEDS = (1, 2, 3)
# A take that times out reads the cluster to say why (an admin request to the group coordinator): at 10 s that
# read often overlaps a broker fault, which is what aborted trainers inside librdkafka (issue 36: 3 aborts in
# one 130 s run of seed 2); at 30 s, none in 2 runs of 120 s.
TRAINER_TIMEOUT_S = 10.0


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else default


def _env_seeds() -> list[int] | None:
    """CHAOS_SEEDS ("1,2,3") or CHAOS_SEED (one); None when neither is set."""
    value = os.environ.get("CHAOS_SEEDS") or os.environ.get("CHAOS_SEED")
    return [int(v) for v in value.replace(",", " ").split()] if value else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", dest="seeds", type=int, action="append", default=None,
                        help="seed of a run's nemesis; repeat for several runs, one after another (default "
                             f"{' '.join(map(str, DEFAULT_SEEDS))}; env CHAOS_SEEDS=1,2,3 or CHAOS_SEED; "
                             "--random-seed: one time-based seed)")
    parser.add_argument("--random-seed", action="store_true", help="one run with a time-based seed (printed first)")
    parser.add_argument("--seconds", type=float, default=_env_int("CHAOS_SECONDS", 120),
                        help="length of each run's nemesis phase (default 120; env CHAOS_SECONDS)")
    parser.add_argument("--nodes", type=int, choices=(1, 3), default=_env_int("NODES", 1),
                        help="broker nodes; 3 adds node kills (default 1; env NODES)")
    parser.add_argument("--port", type=int, default=0, help="first client port of the broker (default: free)")
    parser.add_argument("--take-n", type=int, default=32, help="groups per trainer step (default 32)")
    parser.add_argument("--drain-timeout", type=float, default=300.0,
                        help="seconds the drain may take before it counts as a failure (default 300)")
    parser.add_argument("--no-faults", dest="faults", action="store_false",
                        help="a soak: no nemesis, only load (read the report's memory section)")
    parser.add_argument("--wave", type=int, default=None, help="prompts per wave (default --take-n)")
    parser.add_argument("--gen-delay", default=GEN_DELAY_S, help=f"seconds per group (default {GEN_DELAY_S})")
    parser.add_argument("--trainer", choices=("loop", "cli"), default="loop",
                        help="loop: one long-lived Python trainer (tests.chaos._trainer: take commit=False, "
                             "commit, timeouts retried); cli: `rollstream take --steps 0` (default loop)")
    parser.add_argument("--trainer-timeout", type=float, default=TRAINER_TIMEOUT_S,
                        help="the loop trainer's take and consumer timeout in seconds (default "
                             f"{TRAINER_TIMEOUT_S:g}; issue 36's trainers had 30)")
    parser.add_argument("--trainer-arg", action="append", default=[],
                        help="with --trainer cli, one more argument for its `rollstream take` (repeat; e.g. "
                             "--trainer-arg=--dedupe-window=none)")
    parser.add_argument("--rss-every", type=float, default=5.0, help="seconds between RSS samples (default 5)")
    parser.add_argument("--report", type=Path, default=Path("chaos-report.md"), help="report file")
    parser.add_argument("--tls", action="store_true",
                        help="the broker encrypts every listener (broker start --tls); every client trusts its CA")
    parser.add_argument("--sasl", action="store_true",
                        help="the broker authenticates clients with SASL/SCRAM and authorizes with ACLs (broker start "
                             "--sasl); every client is its admin user")
    parser.add_argument("--keep", action="store_true", help="keep the data dir and logs even on success")
    return parser.parse_args(argv)


class Say:
    """Progress lines with the elapsed time, on stdout and kept for the report's fault log."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.events: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.started:7.1f} s] {message}"
        with self._lock:
            self.events.append(line)
            print(line, flush=True)


class Loader:
    """A named thread loading one wave of fresh prompts every `WAVE_EVERY_S` with `load_prompts`.

    A load refused or cut short by a fault is recorded and not retried (its ids are not reused): what
    reached NS.prompts is read back at the end, so a partial load is still accounted for exactly.
    """

    def __init__(self, config: KafkaConfig, namespace: str, wave_size: int, wave_dir: Path, say: Say) -> None:
        self.config, self.namespace, self.wave_size, self.wave_dir, self.say = config, namespace, wave_size, \
            wave_dir, say
        self.loads = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-loader", daemon=True)
        wave_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, while_waiting: Callable[[], None]) -> None:
        """Load no more waves; wait (up to 120 s) for a load under way, calling `while_waiting` every 0.2 s: the
        nemesis's recoveries stay on time while a load waits out a broker it paused."""
        self._stop.set()
        until = time.monotonic() + 120.0
        while self._thread.is_alive() and time.monotonic() < until:
            self._thread.join(timeout=0.2)
            while_waiting()

    def load_wave(self, wave: int) -> None:
        path = self.wave_dir / f"wave-{wave:04d}.jsonl"
        path.write_text("".join(f'{{"id": "w{wave:04d}-{i:02d}", "prompt": "question {wave}.{i}", "label": "42"}}\n'
                                for i in range(self.wave_size)))
        try:
            load_prompts(path, self.config, namespace=self.namespace, timeout=30.0)
            self.loads += 1
        except Exception as exc:  # noqa: BLE001 - any refusal is a finding to report, not a crash of the run
            self.failures.append(f"wave {wave}: {type(exc).__name__}: {exc}")
            self.say(f"prompt wave {wave} not (fully) loaded: {type(exc).__name__}: {str(exc)[:160]}")

    def _run(self) -> None:
        wave = 0
        while not self._stop.wait(WAVE_EVERY_S):
            wave += 1
            self.load_wave(wave)


class Run:
    """One chaos run: broker, topics, producers, trainer, loader, nemesis, drain, checks, teardown."""

    def __init__(self, args: argparse.Namespace, seed: int, run_dir: Path, say: Say) -> None:
        self.args, self.seed, self.run_dir, self.say = args, seed, run_dir, say
        port = args.port or free_port(args.nodes)
        self.cluster = Cluster(BrokerSpec(port=port, nodes=args.nodes, data_dir=run_dir / "broker",
                                          heap_mb=512 if args.nodes == 1 else 384, tls=args.tls,
                                          sasl=args.sasl))
        # Against a TLS or SASL broker every client, the role processes' too, uses the client file start writes.
        self.client_file = self.cluster.spec.data_dir / "admin.properties" if args.tls or args.sasl else None
        self.client_args = ("--kafka-config", str(self.client_file)) if self.client_file else ()
        self.names = TopicNames(f"chaos{seed}")
        self.out = run_dir / "trainer-out.jsonl"
        self.producers: list[Role] = []
        self.trainer: Role | None = None
        self.topup: Role | None = None
        self.nemesis: Nemesis | None = None
        self.loader: Loader | None = None
        self.rss: RssSampler | None = None
        self.config: KafkaConfig | None = None
        self.drain_s = 0.0
        self.drain_problem: str | None = None
        self.bad_exits: list[str] = []  # process ends on our stop that were wrong (a foreign signal, a traceback)

    def execute(self) -> Verdict:
        bootstrap = self.cluster.start()
        self.say(f"broker up: {self.args.nodes} node(s) on {bootstrap}, data dir {self.cluster.spec.data_dir}")
        config = self.config = KafkaConfig.load(bootstrap, self.client_file)
        create_topics(TopicPlan(names=self.names, partitions=PARTITIONS, replication_factor=self.args.nodes), config)
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.producers = [producer_role(f"producer-{i}", bootstrap, self.names.namespace, GROUP, logs,
                                        exit_when_idle_s=8.0, gen_delay_s=self.args.gen_delay,
                                        extra=self.client_args)
                          for i in range(1, PRODUCERS + 1)]
        self.trainer = self._trainer(bootstrap, logs)
        self.loader = Loader(config, self.names.namespace, self.args.wave or self.args.take_n,
                             self.run_dir / "prompts", self.say)
        self.loader.load_wave(0)
        for role in [*self.producers, self.trainer]:
            role.start()
        self.rss = RssSampler([*self.producers, self.trainer], every_s=self.args.rss_every)
        self.rss.start()
        self.loader.start()
        self.say(f"namespace {self.names.namespace}: {PRODUCERS} producers, trainer taking {self.args.take_n} "
                 f"per step, a wave of {self.args.wave or self.args.take_n} prompts every {WAVE_EVERY_S:g} s"
                 + ("" if self.args.faults else "; no faults (a soak)"))
        self.nemesis = Nemesis(random.Random(self.seed), self.cluster, self.producers, self.trainer, self.say)
        self._nemesis_phase(self.nemesis)
        self.loader.stop(while_waiting=self.nemesis.tick)
        if self.rss is not None:
            self.rss.stop()  # the memory of the load phase; the drain's is not a steady state
        self.say(f"nemesis over: {sum(self.nemesis.counts.values())} faults; draining")
        started = time.monotonic()
        self._drain(self.nemesis, config)
        self.drain_s = time.monotonic() - started
        self.say("checking: audit, every committed step replayed, --out compared")
        return check(config, self.names, GROUP, self.out)

    def _trainer(self, bootstrap: str, logs: Path) -> Role:
        if self.args.trainer == "loop" and not self.client_file:
            return loop_trainer_role(bootstrap, self.names.namespace, GROUP, self.out, logs, n=self.args.take_n,
                                     timeout_s=self.args.trainer_timeout)
        return trainer_role(bootstrap, self.names.namespace, GROUP, self.out, logs, n=self.args.take_n,
                            extra=(*self.args.trainer_arg, *self.client_args))

    def stop_role(self, role: Role, timeout_s: float = 30.0) -> None:
        """Stop `role` (`Role.terminate`) and record a wrong end."""
        failure = role.terminate(timeout_s)
        if failure is not None:
            self.bad_exits.append(failure)
            self.say(f"FAILURE: {failure.splitlines()[0]}")

    @property
    def exit_failures(self) -> list[str]:
        """Every wrong end of a trainer or producer process: during the nemesis and the drain, and at its stop."""
        return [*(self.nemesis.failures if self.nemesis else []), *self.bad_exits]

    def _nemesis_phase(self, nemesis: Nemesis) -> None:
        end = time.monotonic() + self.args.seconds
        next_fault = time.monotonic() + nemesis.rng.uniform(*FAULT_GAP_S)
        next_status = time.monotonic() + 15.0
        while time.monotonic() < end:
            nemesis.tick()
            if self.args.faults and time.monotonic() >= next_fault:
                nemesis.inject()
                next_fault = time.monotonic() + nemesis.rng.uniform(*FAULT_GAP_S)
            if time.monotonic() >= next_status:
                self.say(self._status())
                next_status += 15.0
            time.sleep(0.2)

    def _status(self) -> str:
        loads = self.loader.loads if self.loader else 0
        # No Kafka call here: during a broker pause it would hold up the recoveries that are due.
        return f"status: {loads} waves loaded, {len(taken_in_out_file(self.out))} groups in --out"

    def _lag(self) -> int | None:
        if self.config is None:
            return None
        try:
            with LagReader(self.config) as reader:
                return reader.group_lag(GROUP, self.names.rollouts, timeout=5.0).total
        except Exception:  # noqa: BLE001 - a status line during a broker fault; None says "unknown"
            return None

    def _drain(self, nemesis: Nemesis, config: KafkaConfig) -> None:
        """Undo every fault, let the producers finish, let the trainer take all it can, then top up the last step."""
        nemesis.heal()
        self.cluster.start()  # adopts the running broker and waits until it serves
        self.say("drain: every fault undone, broker serves; waiting for producers (--exit-when-idle) and trainer")
        deadline = time.monotonic() + self.args.drain_timeout
        last, still_since = None, time.monotonic()
        while True:
            nemesis.tick(restart_exited=False)
            done = not any(p.alive for p in self.producers)
            seen = (self._lag(), self.out.stat().st_size if self.out.exists() else 0, done)
            if seen != last:
                last, still_since = seen, time.monotonic()
            if done and seen[0] is not None and time.monotonic() - still_since >= SETTLE_S:
                break
            if time.monotonic() > deadline:
                self.drain_problem = (f"not settled after {self.args.drain_timeout:.0f} s (producers done: {done}, "
                                      f"trainer lag {seen[0]})")
                self.say(f"drain: {self.drain_problem}")
                return
            time.sleep(1.0)
        if self.trainer is not None:
            self.stop_role(self.trainer)
        self._top_up(config, lag=seen[0])

    def _top_up(self, config: KafkaConfig, lag: int | None) -> None:
        """A last `rollstream take -n R --steps 1` for the R < n groups the trainer could not make a step of."""
        report = audit(config, self.names.namespace, GROUP, timeout=60.0)
        left = len(loaded_group_ids(config, self.names)) - report.counts["taken"] - report.counts["filtered"]
        self.say(f"drain: producers done, trainer settled (lag {lag}) and stopped; {left} group(s) left over")
        if left <= 0:
            return
        if left >= self.args.take_n:
            self.drain_problem = f"the trainer stopped taking with {left} groups left (>= a step of " \
                                 f"{self.args.take_n}; lag {lag}): wedged"
            self.say(f"drain: {self.drain_problem}")
        if self.trainer is None:
            return
        self.topup = trainer_role(config.bootstrap_servers, self.names.namespace, GROUP, self.out,
                                  self.trainer.log_path.parent, n=left, steps=1, name="trainer-topup",
                                  extra=self.client_args)
        self.topup.start()
        code = self.topup.wait(120.0)
        self.say(f"drain: top-up step of {left} group(s) exited with rc {code}")
        if code != 0:
            self.drain_problem = (self.drain_problem or "") + f" top-up take -n {left} exited with rc {code}: " \
                                                              f"{self.topup.tail(5)}"

    def teardown(self) -> None:
        """Stop the loader and every process, then the broker (always, even when a step before fails)."""
        try:
            if self.loader is not None:
                self.loader.stop(while_waiting=lambda: None)
            if self.rss is not None:
                self.rss.stop()
            for role in [*self.producers, *(r for r in (self.trainer, self.topup) if r is not None)]:
                self.stop_role(role, timeout_s=20.0)
        finally:
            self.cluster.stop()


def run_seed(args: argparse.Namespace, seed: int) -> tuple[bool, str]:
    """One chaos run with `seed`: (passed, its report)."""
    command = f"python -m tests.chaos --seed {seed} --seconds {args.seconds:g} --nodes {args.nodes}"
    command += "".join([" --no-faults"] * (not args.faults) + [f" --wave {args.wave}"] * bool(args.wave)
                       + [f" --take-n {args.take_n}"] * (args.take_n != 32)
                       + [f" --gen-delay {args.gen_delay}"] * (args.gen_delay != GEN_DELAY_S)
                       + [f" --trainer {args.trainer}"] * (args.trainer != "loop")
                       + [f" --trainer-timeout {args.trainer_timeout:g}"] * (args.trainer_timeout != TRAINER_TIMEOUT_S)
                       + [f" --trainer-arg={a}" for a in args.trainer_arg]
                       + [" --tls"] * args.tls + [" --sasl"] * args.sasl)
    print(f"chaos seed {seed}  (repeat: {command})", flush=True)
    say = Say()
    run_dir = Path(tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    run = Run(args, seed, run_dir, say)
    verdict: Verdict | None = None
    error = None
    try:
        verdict = run.execute()
    except KeyboardInterrupt:
        error = "interrupted (Ctrl-C)"
    except Exception:  # noqa: BLE001 - the report must still be written and everything stopped
        error = traceback.format_exc()
    finally:
        try:
            run.teardown()
        except Exception:  # noqa: BLE001
            error = (error or "") + "\nteardown: " + traceback.format_exc()
    nemesis = run.nemesis
    facts = RunFacts(seed=seed, nodes=args.nodes, seconds=args.seconds, command=command,
                     faults=nemesis.counts if nemesis else Counter(),
                     events=say.events, loads=run.loader.loads if run.loader else 0,
                     load_failures=run.loader.failures if run.loader else [],
                     unexpected_exits=nemesis.unexpected_exits if nemesis else [], drain_s=run.drain_s,
                     drain_problem=run.drain_problem, error=error, rss=run.rss.series if run.rss else [],
                     exit_failures=run.exit_failures)
    text = render(facts, verdict)
    print("\n" + text, flush=True)
    ok = facts.passed(verdict)
    if ok and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"data dir and logs kept in {run_dir}", flush=True)
    print(f"chaos {'PASS' if ok else 'FAIL'} (seed {seed})", flush=True)
    return ok, text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.random_seed:
        seeds = [int(time.time() * 1000) % 1_000_000_007]
    else:
        seeds = args.seeds or _env_seeds() or list(DEFAULT_SEEDS)
    results = [(seed, *run_seed(args, seed)) for seed in seeds]
    summary = ["# Chaos runs", "", *(f"- seed {seed}: {'PASS' if ok else '**FAIL**'}" for seed, ok, _ in results), ""]
    args.report.write_text("\n".join(summary) + "\n" + "\n".join(text for _, _, text in results))
    failed = [seed for seed, ok, _ in results if not ok]
    print(f"chaos {'FAIL' if failed else 'PASS'}: {len(results)} run(s), seeds {seeds}"
          + (f"; failed: {failed}" if failed else "") + f"; report in {args.report}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
