"""One fleet phase: a namespace, N producers in ceil(N/M) processes, one trainer, a window of S seconds,
a drain, and the checks (every loaded prompt's group taken exactly once, `rollstream.consumers.audit` green).

Figures are taken over the *window* only (from the moment every producer runs, after a short warm-up,
for S seconds): startup (joining the intake group) and the drain would otherwise dilute them.
Rates of the worker counters use each worker's own tick times at the window's edges.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rollstream.infra import KafkaConfig, LagReader, TopicNames, TopicPlan, create_topics
from rollstream.infra.clients import open_admin
from rollstream.infra.config import MiB
from rollstream.producers import ProducerSettings

from tests.chaos._cluster import Cluster
from tests.fleet._broker_metrics import BrokerRequests, window_figures
from tests.fleet._churn import Churn, FleetError
from tests.fleet._probes import calibrate_lag_read, percentiles_ms, requests_per_call
from tests.fleet._roles import LagSampler, Loader, Trainer, WorkerProc, verdict

GROUP = "fleet-trainer"
WARMUP_S = 3.0
STARTUP_TIMEOUT_S = 240.0
# Each producer's own (ProducerSettings.startup_timeout_s): over TLS and SASL 128 producers' first lag reads
# (256 ListOffsets each) and their clients' handshakes, all at once on 2 cores, took longer than 60 s.
PRODUCER_STARTUP_S, SECURED_PRODUCER_STARTUP_S = 60.0, 180.0
DRAIN_TIMEOUT_S = 180.0
STALL_S = 15.0
FINISHERS = 8
PROGRESS_S = 5.0


@dataclass(frozen=True)
class PhaseSpec:
    index: int
    mode: str  # pushed | poll
    producers: int
    per_process: int
    partitions: int
    seconds: float
    concurrency: int
    max_lag: int
    n_samples: int
    take_n: int
    step_ms: float
    gen_ms: tuple[float, float]
    seed: int
    fallback_s: float | None = None  # ProducerSettings.lag_fallback_s for pushed (None: its default)
    rule: str = "share"  # share: max_lag is the fleet's (today's gate); old: each producer's own (the rule before it)
    churn: bool = False  # --churn: a worker killed and replaced, one drained, a broker node killed and restarted
    churn_node: int = 2

    @property
    def read_interval_s(self) -> float:
        """How often each gate reads the lag itself in this mode (what a read costs x N / this = nominal)."""
        defaults = ProducerSettings()
        if self.mode == "poll":
            return defaults.lag_interval_s
        return self.fallback_s or float(getattr(defaults, "lag_fallback_s", defaults.lag_interval_s))

    @property
    def label(self) -> str:
        return f"{self.mode}{'-old' if self.rule == 'old' else ''} x{self.producers}{' churn' if self.churn else ''}"

    @property
    def in_flight_bound(self) -> int:
        """max_lag + every producer's concurrency: the most the lag can reach (the README's guarantees)."""
        return self.max_lag + self.producers * self.concurrency


class Phase:
    def __init__(self, spec: PhaseSpec, bootstrap: str, run_dir: Path, say: Callable[[str], None],
                 calibration: dict[str, float] | None, broker: BrokerRequests | None = None,
                 cluster: Cluster | None = None, client_file: Path | None = None) -> None:
        self.spec, self.say, self.calibration, self.broker = spec, say, calibration, broker
        self.cluster, self.client_file = cluster, client_file  # client_file: --tls/--sasl, every client's settings
        self.config = KafkaConfig.load(bootstrap, client_file, client_id="fleet-driver")
        self.names = TopicNames(f"fleet{spec.seed}-{spec.index}-{spec.mode}-{spec.producers}")
        self.logs = run_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.workers: list[WorkerProc] = []  # the fleet measured
        self.active: list[WorkerProc] = []  # the processes running now (the fleet, or finishers after a stall)
        self.finishers: list[WorkerProc] = []
        self.killed: list[WorkerProc] = []  # --churn: SIGKILLed (no final line; out of the checks of a clean stop)
        self.drained: list[WorkerProc] = []  # --churn: sent SIGTERM (must stop cleanly, rc 0, a final line)
        self.churn: Churn | None = None
        self.stalled: dict[str, Any] | None = None
        self.trainer: Trainer | None = None
        self.loader: Loader | None = None
        self.sampler: LagSampler | None = None
        self.started = time.time()

    # -- running ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        s = self.spec
        plan = TopicPlan(names=self.names, partitions=s.partitions, replication_factor=3, max_message_bytes=MiB)
        create_topics(plan, self.config)
        self._wait_known_everywhere([t.name for t in plan.topics()])
        if self.calibration is None:
            self.calibration = calibrate_lag_read(self.config, GROUP, self.names.rollouts)
            self.say(f"calibrated: one lag read of {s.partitions} partitions = {_describe(self.calibration)} "
                     "(librdkafka statistics)")
        trainer = self.trainer = Trainer(self.config, self.names.namespace, GROUP, take_n=s.take_n,
                                         step_s=s.step_ms / 1000.0)
        sampler = self.sampler = LagSampler(self.config, self.names.rollouts, s.partitions,
                                            lambda: trainer.facts.committed, commits=lambda: trainer.facts.commits)
        # Unstarted prompts kept on NS.prompts: a few per partition and twice what the fleet holds in flight.
        backlog = max(4 * s.take_n, 2 * s.producers * s.concurrency, 4 * s.partitions)
        loader = self.loader = Loader(self.config, self.names, f"p{s.index}", backlog=backlog,
                                      produced=lambda: sampler.ends)
        loader.load(backlog)
        trainer.start()
        sampler.start()
        self._start_workers(self.config.bootstrap_servers)
        loader.start()
        up_s = self._wait_running()
        self.say(f"{s.label}: all {s.producers} producers running after {up_s:.1f} s; warm-up {WARMUP_S:g} s, "
                 f"then a {s.seconds:g} s window")
        self._watch(time.time() + WARMUP_S, quiet=True)
        control_at_t0, broker_at_t0 = self._control_end(), self._broker_snapshot()
        t0 = time.time()
        if s.churn:
            if self.cluster is None:
                raise FleetError("--churn needs the cluster")
            self.churn = Churn(self, self.cluster, s.churn_node)
            t1 = self.churn.run(t0, self._watch)
        else:
            self._watch(t0 + s.seconds)
            t1 = time.time()
        control_at_t1, broker_at_t1 = self._control_end(), self._broker_snapshot()
        loader.stop()
        drain_s = self._drain()
        for w in self.drained:
            w.wait(60.0)
        result = self._figures(t0, t1, (control_at_t1 - control_at_t0) / (t1 - t0))
        if self.churn is not None:
            result["churn"] = self.churn.figures(sampler.samples, trainer.facts.steps, t1, self.started,
                                                 across=sampler.across, failed_at=sampler.failed_at)
            result["lag"].update(bound=result["churn"]["bound_max"], within_bound=result["churn"]["within_bound"])
        result["broker"] = window_figures(broker_at_t0, broker_at_t1)
        result.update(startup_s=round(up_s, 1), drain_s=round(drain_s, 1), stalled=self.stalled)
        result["checks"] = self._check()
        self._delete_topics()
        return result

    def _delete_topics(self) -> None:
        """Drop the phase's topics once checked: the next phase's brokers then replicate only their own."""
        admin = open_admin(self.config.admin())
        n = self.names
        futures = admin.delete_topics([n.prompts, n.rollouts, n.steps, n.control, n.inflight], operation_timeout=30.0)
        for topic, future in futures.items():
            try:
                future.result(timeout=60.0)
            except Exception as exc:  # noqa: BLE001 - a topic left behind costs the next phase a little, no more
                self.say(f"could not delete {topic}: {exc}")

    def _wait_known_everywhere(self, topics: list[str], timeout_s: float = 30.0) -> None:
        """Until every node's metadata lists `topics`. `create_topics` returns once the partitions have
        leaders, as one node sees it; another node may not list the topics yet for a moment, and a client
        that asks that node first (a producer's `require_topics`) would find them missing."""
        deadline = time.monotonic() + timeout_s
        for address in self.config.bootstrap_servers.split(","):
            while True:
                # A fresh client with one bootstrap address asks that node first.
                admin = open_admin(replace(self.config, bootstrap_servers=address).admin())
                known = set(admin.list_topics(timeout=10.0).topics)
                if set(topics) <= known:
                    break
                if time.monotonic() > deadline:
                    raise FleetError(f"node {address} does not list {sorted(set(topics) - known)} "
                                     f"{timeout_s:.0f} s after they were created")
                time.sleep(0.2)

    def _start_workers(self, bootstrap: str) -> None:
        s = self.spec
        for k in range(math.ceil(s.producers / s.per_process)):
            first = k * s.per_process
            self.workers.append(self._worker(bootstrap, k, s.mode, first, min(s.per_process, s.producers - first)))
        self.active = list(self.workers)

    def _worker(self, bootstrap: str, proc: int | str, mode: str, first: int, count: int) -> WorkerProc:
        s = self.spec
        spec = {"proc": proc, "phase": s.index, "bootstrap": bootstrap, "namespace": self.names.namespace,
                "trainer_group": GROUP, "backpressure": mode, "first_index": first, "count": count,
                "n_samples": s.n_samples, "concurrency": s.concurrency, "max_lag": s.max_lag,
                "gen_ms": list(s.gen_ms), "seed": s.seed, "fallback_s": s.fallback_s, "rule": s.rule,
                "kafka_config": str(self.client_file) if self.client_file else None,
                "startup_timeout_s": SECURED_PRODUCER_STARTUP_S if self.client_file else PRODUCER_STARTUP_S}
        return WorkerProc(spec, self.logs / f"phase{s.index}-{s.mode}-{s.producers}-proc{proc}.log")

    def _check_workers(self) -> None:
        for w in self.active:
            if not w.alive:
                raise FleetError(f"producer process {w.spec['proc']} exited with rc {w.proc.returncode}; "
                                 f"its log {w.log_path}:\n{w.log_tail()}")
            errors = w.latest.get("errors")
            if errors:
                raise FleetError(f"producer process {w.spec['proc']}: {errors[0]}")
        for role in (self.trainer, self.loader, self.sampler):
            error = getattr(role, "error", None) or (role.facts.error if isinstance(role, Trainer) else None)
            if error:
                raise FleetError(error)

    def _wait_running(self) -> float:
        started = time.monotonic()
        next_say = started + PROGRESS_S
        while True:
            self._check_workers()
            running = sum(w.latest.get("running", 0) for w in self.workers)
            if running >= self.spec.producers:
                return time.monotonic() - started
            if time.monotonic() - started > STARTUP_TIMEOUT_S:
                raise FleetError(f"only {running} of {self.spec.producers} producers started within "
                                 f"{STARTUP_TIMEOUT_S:.0f} s; logs in {self.logs}")
            if time.monotonic() >= next_say:
                self.say(f"{self.spec.label}: {running}/{self.spec.producers} producers started")
                next_say += PROGRESS_S
            time.sleep(0.2)

    def _watch(self, until: float, *, quiet: bool = False) -> None:
        next_say = time.time() + PROGRESS_S
        last_taken, last_t = self._taken(), time.time()
        while time.time() < until:
            self._check_workers()
            time.sleep(min(0.2, max(0.0, until - time.time())))
            if not quiet and time.time() >= next_say:
                taken, now = self._taken(), time.time()
                self.say(self._progress((taken - last_taken) / (now - last_t)))
                last_taken, last_t, next_say = taken, now, next_say + PROGRESS_S

    def _taken(self) -> int:
        return self.trainer.facts.taken_total if self.trainer else 0

    def _progress(self, rate: float) -> str:
        lag = self.sampler.samples[-1][1] if self.sampler and self.sampler.samples else -1
        ticks = [w.latest for w in self.active]
        in_flight = sum(t.get("in_flight", 0) for t in ticks)
        paused = sum(t.get("paused", 0) for t in ticks)
        loop_p99 = max((t.get("loop_lag_ms", {}).get("p99", 0.0) for t in ticks), default=0.0)
        reads = sum(t.get("lag_calls", {}).get("gate.read", 0) for t in ticks)
        bound = self.churn.events[-1].bound if self.churn and self.churn.events else self.spec.in_flight_bound
        alive = sum(int(w.spec["count"]) for w in self.active)
        return (f"{self.spec.label}: {rate:6.0f} groups/s  lag {lag:4d} (max_lag {self.spec.max_lag}, bound "
                f"{bound})  in flight {in_flight:4d}  paused {paused:3d}/{alive}  "
                f"loop lag p99 {loop_p99:5.1f} ms  gate reads so far {reads}")

    def _broker_snapshot(self) -> tuple[float, dict[str, int]] | None:
        if self.broker is None:
            return None
        try:
            return self.broker.snapshot()
        except RuntimeError as exc:
            self.say(f"broker metrics: {exc}; going on without them")
            self.broker = None
            return None

    def _control_end(self) -> int:
        """Records on NS.control so far: the trainer's positions (the fleet announces no policy version)."""
        with LagReader(self.config) as reader:
            return sum(p.end for p in reader.group_lag("fleet-control-probe", self.names.control, timeout=30.0)
                       .partitions)

    def _drain(self) -> float:
        """Every prompt committed by the producers (their group's lag on NS.prompts is 0), nothing in
        flight; then the producers stop and the trainer takes what is left.

        A fleet that commits nothing for `STALL_S` (seen: polling gates whose every lag read times out
        keep their last, high estimate and stay closed) is recorded as stalled, stopped, and replaced by
        `FINISHERS` fresh producers in ``pushed`` mode, which finish the prompts: the check then still
        proves nothing was lost or duplicated across the stall."""
        started = time.monotonic()
        self.say(f"{self.spec.label}: window over; draining {self.loader.loaded if self.loader else 0} prompts")
        intake_group = f"{self.names.namespace}.producers"
        best, best_at = None, time.monotonic()
        with LagReader(self.config) as reader:
            while True:
                self._check_workers()
                left = reader.group_lag(intake_group, self.names.prompts, timeout=30.0).total
                if left == 0 and all(w.latest.get("in_flight", 1) == 0 for w in self.active):
                    break
                if best is None or left < best:
                    best, best_at = left, time.monotonic()
                elif time.monotonic() - best_at > STALL_S and self.stalled is None:
                    self._replace_stalled_fleet(left, time.monotonic() - started)
                    best_at = time.monotonic()
                if time.monotonic() - started > DRAIN_TIMEOUT_S:
                    raise FleetError(f"drain: {left} prompts still uncommitted after {DRAIN_TIMEOUT_S:.0f} s")
                time.sleep(0.5)
        self.stop_workers()
        if self.trainer is not None and self.loader is not None:
            self.trainer.finish(self.loader.loaded)
        if self.sampler is not None:
            self.sampler.stop()
        return time.monotonic() - started

    def _replace_stalled_fleet(self, left: int, after_s: float) -> None:
        calls = [w.latest.get("lag_calls", {}) for w in self.active]
        reads, failed = (sum(c.get(f"gate.{k}", 0) for c in calls) for k in ("read", "read_failed"))
        self.stalled = {"uncommitted": left, "stall_s": STALL_S, "after_drain_s": round(after_s, 1),
                        "gate_reads": reads, "gate_reads_failed": failed, "finishers": FINISHERS}
        self.say(f"{self.spec.label}: STALLED: {left} prompts uncommitted and none committed for {STALL_S:g} s "
                 f"({failed} of {reads} gate lag reads failed); stopping the fleet, finishing with {FINISHERS} "
                 "fresh pushed-mode producers")
        self.stop_workers()
        # Static members keep their partitions until their session expires (ProducerSettings.session_timeout_s).
        self.active = [self._worker(self.config.bootstrap_servers, "finisher", "pushed", 10_000, FINISHERS)]
        self.finishers = list(self.active)

    def stop_workers(self, timeout_s: float = 60.0) -> None:
        """Ask the active producer processes to stop (graceful: in flight finishes, prompts commit); wait."""
        for w in self.active:
            w.ask_stop()
        deadline = time.monotonic() + timeout_s
        for w in self.active:
            w.wait(max(1.0, deadline - time.monotonic()))

    def teardown(self) -> None:
        """After a failure: stop everything this phase started (idempotent)."""
        for role in (self.loader, self.sampler, self.trainer):
            if role is not None:
                role.stop()
        for w in self.active:
            if w.alive:
                w.proc.terminate()
        self.stop_workers(20.0)

    # -- figures ---------------------------------------------------------------------------------

    def _figures(self, t0: float, t1: float, positions_per_s: float) -> dict[str, Any]:
        s = self.spec
        window = t1 - t0
        steps = [st for st in self.trainer.facts.steps if t0 <= st[0] <= t1] if self.trainer else []
        lag = [(t, v) for t, v in (self.sampler.samples if self.sampler else []) if t0 <= t <= t1]
        lag_values = [v for _, v in lag] or [0]
        loop = [x for w in self.workers for tick in w.ticks if t0 <= tick["t"] <= t1 for x in tick["loop_lag_s"]]
        return {
            "label": s.label, "spec": asdict(s), "namespace": self.names.namespace, "window_s": round(window, 2),
            "window": [round(t0 - self.started, 2), round(t1 - self.started, 2)],
            "groups_per_s": round(sum(n for _, n, _ in steps) / window, 1),
            "published_per_s": round(self._rate(t0, t1, lambda tick: tick["groups_ok"]), 1),
            "steps_per_s": round(len(steps) / window, 2),
            "lag": {"max": max(lag_values), "mean": round(statistics.fmean(lag_values), 1),
                    "p99": sorted(lag_values)[min(len(lag_values) - 1, int(0.99 * len(lag_values)))],
                    "over_max_lag_fraction": round(sum(v > s.max_lag for v in lag_values) / len(lag_values), 3),
                    "max_lag": s.max_lag, "bound": s.in_flight_bound,
                    "within_bound": max(lag_values) <= s.in_flight_bound},
            "loop_lag_ms": percentiles_ms(loop),
            "loop_lag_ms_by_process": {str(w.spec["proc"]): percentiles_ms(
                [x for tick in w.ticks if t0 <= tick["t"] <= t1 for x in tick["loop_lag_s"]]) for w in self.workers},
            "backpressure": self._backpressure(t0, t1, positions_per_s),
            "series": self._series(),
        }

    def _backpressure(self, t0: float, t1: float, positions_per_s: float) -> dict[str, Any]:
        """Broker requests per second the gates cause (their calls x the calibrated requests per call), and
        the pushed signal (positions on NS.control); the control watchers' fetches beside them."""
        s, cal = self.spec, self.calibration or {}
        per_call = requests_per_call(cal, s.partitions)

        def calls(name: str) -> float:
            return self._rate(t0, t1, lambda tick: tick["lag_calls"].get(f"gate.{name}", 0))

        by_api: dict[str, float] = {}
        for call, apis in per_call.items():
            rate = calls(call)
            for api, per in apis.items():
                by_api[api] = by_api.get(api, 0.0) + rate * per
        gate = sum(by_api.values())
        reads = calls("read")
        signal = positions_per_s if s.mode == "pushed" else 0.0
        control = self._rate(t0, t1, lambda tick: tick["control_requests"].get("Fetch", 0))
        interval_s = s.read_interval_s
        return {
            "gate_reads_per_s": round(reads, 2),
            # A read that started before the window may fail inside it: the share is capped at all of them.
            "gate_reads_failed_fraction": round(min(1.0, calls("read_failed") / reads), 3) if reads else 0.0,
            "gate_requests_per_s": round(gate, 1),
            "gate_requests_per_s_by_api": {api: round(v, 1) for api, v in sorted(by_api.items())},
            "gate_requests_per_s_per_producer": round(gate / s.producers, 2),
            "nominal_gate_requests_per_s": round(s.producers / interval_s * sum(cal.values()), 1),
            "requests_per_read": cal,
            "positions_per_s": round(positions_per_s, 2),
            "signal_requests_per_s": round(signal, 2),
            "total_requests_per_s": round(gate + signal, 1),
            "control_fetch_per_s": round(control, 1),
            "control_fetch_per_s_per_producer": round(control / s.producers, 2),
            "pushed_updates_per_s": round(self._rate(t0, t1, lambda tick: tick["lag_updates"]["pushed"]), 1),
        }

    def _rate(self, t0: float, t1: float, value: Callable[[dict[str, Any]], float]) -> float:
        """Sum over workers of (value at its last tick <= t1 - value at its first tick >= t0) / their gap."""
        total = 0.0
        for w in self.workers:
            inside = [tick for tick in w.ticks if t0 <= tick["t"] <= t1]
            if len(inside) >= 2 and inside[-1]["t"] > inside[0]["t"]:
                total += (value(inside[-1]) - value(inside[0])) / (inside[-1]["t"] - inside[0]["t"])
        return total

    def _series(self) -> dict[str, Any]:
        origin = self.started
        in_flight: dict[int, int] = {}
        for w in self.workers:
            for tick in w.ticks:
                second = int(tick["t"] - origin)
                in_flight[second] = in_flight.get(second, 0) + tick["in_flight"]
        return {"lag": [(round(t - origin, 2), v) for t, v in (self.sampler.samples if self.sampler else [])],
                "lag_during_commits": [(round(t - origin, 2), v) for t, v in (self.sampler.across if self.sampler
                                                                              else [])],
                "in_flight": sorted(in_flight.items())}

    # -- checks ----------------------------------------------------------------------------------

    def _check(self) -> dict[str, Any]:
        if self.trainer is None or self.loader is None:
            raise FleetError("no trainer or loader")
        checks = verdict(self.config, self.names, GROUP, self.trainer.facts, self.loader,
                         [w for w in self.workers if w not in self.killed] + self.finishers)
        bad = [f"drained producer process {w.spec['proc']} ended with rc {w.proc.returncode}: {w.log_tail(3)}"
               for w in self.drained if w.proc.returncode != 0]
        if self.killed or self.drained:
            checks.update(killed_processes=[w.spec["proc"] for w in self.killed],
                          drained_processes=[w.spec["proc"] for w in self.drained])
        if bad:
            checks["errors"] += bad
            checks["ok"] = False
        return checks


def _describe(calibration: dict[str, float]) -> str:
    parts = ", ".join(f"{n:g} {api}" for api, n in calibration.items())
    return f"{sum(calibration.values()):g} requests ({parts})"
