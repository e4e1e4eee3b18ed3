"""``make fleet``: ``python -m tests.fleet [--producers N] [--seconds S] [--backpressure both]`` (see `tests.fleet`)."""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from rollstream.infra import KafkaConfig
from rollstream.infra.broker import BrokerError, BrokerSpec, free_port

import tests.fleet as fleet_package
from tests.chaos._cluster import Cluster
from tests.fleet._broker_metrics import BrokerRequests
from tests.fleet._churn import MIN_PROCESSES
from tests.fleet._control_idle import measure
from tests.fleet._phase import FleetError, Phase, PhaseSpec
from tests.fleet._report import render, write

MODES = ("poll", "pushed")


def _gen_ms(text: str) -> tuple[float, float]:
    try:
        lo, _, hi = text.partition(",")
        low, high = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gen-ms {text!r}: give LOW,HIGH in milliseconds, e.g. 5,50") from None
    if not 0 <= low <= high:
        raise argparse.ArgumentTypeError(f"--gen-ms {text!r}: need 0 <= LOW <= HIGH")
    return low, high


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.fleet", description=fleet_package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--producers", type=_positive, default=128, help="producers in the (large) fleet (default 128)")
    add("--small", type=int, default=None,
        help="a second, smaller fleet size, run after --producers (default with --backpressure both: producers/4; "
             "with one mode: none; 0: none)")
    add("--per-process", type=_positive, default=32, help="producers per OS process, on one event loop (default 32)")
    add("--seconds", type=float, default=25.0, help="measured window of each phase, in seconds (default 25)")
    add("--partitions", type=_positive, default=128,
        help="partitions of NS.prompts and NS.rollouts (default 128; at least --producers keeps all busy)")
    add("--backpressure", choices=(*MODES, "both"), default=None,
        help="gate mode: pushed (trainer positions on NS.control), poll (lag reads every 0.5 s), or both "
             "(each at --producers and --small; default, and pushed with --churn)")
    add("--concurrency", type=_positive, default=4, help="groups in flight per producer (default 4)")
    add("--max-lag", type=int, default=64, help="the fleet's max_lag (each producer's with the old rule; default 64)")
    add("--n-samples", type=_positive, default=4, help="completions per group (default 4)")
    add("--take-n", type=_positive, default=32, help="groups per trainer step (default 32)")
    add("--step-ms", type=float, default=20.0, help="modelled trainer step between take and commit (default 20)")
    add("--gen-ms", type=_gen_ms, default=(5.0, 50.0), help="generation latency LOW,HIGH ms, uniform (default 5,50)")
    add("--fallback-s", type=float, default=None,
        help="pushed mode's lag_fallback_s: how often each gate still reads the lag itself (default: "
             "ProducerSettings' own)")
    add("--compare-old", action="store_true",
        help="also run each pushed phase with the gate rule before issue 25 (max_lag per producer, no share), "
             "right after it: the two side by side in one run")
    add("--idle-watchers", default=None,
        help="after the phases, count the Fetch requests of this many idle NS.control watchers (comma-separated "
             "sizes; empty: skip; default 32,128, and none with --churn)")
    add("--churn", action="store_true",
        help="change the fleet while the trainer takes (tests.fleet._churn): --seconds of baseline, then one "
             "producer process SIGKILLed and a new one started, one drained with SIGTERM, one broker node "
             "SIGKILLed, that node restarted, each followed by --seconds; reports the lag against the bound of "
             "each moment and the trainer's recovery after each event (needs >= 3 processes: --per-process)")
    add("--churn-node", type=int, choices=(1, 2, 3), default=2, help="the broker node --churn kills (default 2)")
    add("--seed", type=int, default=None, help="seed of the latency draws and the namespaces (default: time)")
    add("--port", type=int, default=0, help="first client port of the cluster (default: a free range)")
    add("--tls", action="store_true",
        help="the cluster encrypts every listener (broker start --tls); every client (producer processes, trainer, "
             "loader, lag sampler, checks, the churn's node restart) trusts its CA; with it or --sasl each producer "
             "gets 180 s to start, not 60")
    add("--sasl", action="store_true",
        help="the cluster authenticates clients with SASL/SCRAM and authorizes with ACLs (broker start --sasl); "
             "every client is its admin user")
    add("--out", type=Path, default=Path("fleet-out"), help="where fleet.json and fleet.png go (default fleet-out)")
    add("--keep", action="store_true", help="keep the cluster's data dir and the logs even on success")
    args = parser.parse_args(argv)
    if args.max_lag < 0:
        parser.error("--max-lag must be >= 0")
    if args.seconds <= 0:
        parser.error("--seconds must be > 0")
    if args.fallback_s is not None and args.fallback_s <= 0:
        parser.error("--fallback-s must be > 0")
    if args.backpressure is None:
        args.backpressure = "pushed" if args.churn else "both"
    if args.idle_watchers is None:
        args.idle_watchers = "" if args.churn else "32,128"
    if args.churn:
        sizes = [args.producers] + ([args.small] if args.small else [])
        few = [n for n in sizes if -(-n // args.per_process) < MIN_PROCESSES]
        if few:
            parser.error(f"--churn kills one producer process and drains another: {few} producers at "
                         f"--per-process {args.per_process} make fewer than {MIN_PROCESSES} processes")
    return args


def plan(args: argparse.Namespace, seed: int) -> list[PhaseSpec]:
    modes = MODES if args.backpressure == "both" else (args.backpressure,)
    # The second size: a quarter with `both` (unless --small says otherwise), and with one mode only if asked.
    small = args.small if args.small is not None else (max(1, args.producers // 4) if len(modes) > 1 else 0)
    sizes = [args.producers] + ([small] if 0 < small < args.producers else [])
    rules = ("share", "old") if args.compare_old else ("share",)
    combos = [(mode, size, rule) for size in sizes for mode in modes for rule in rules
              if rule == "share" or mode == "pushed"]
    return [PhaseSpec(index=i, mode=mode, producers=size, per_process=args.per_process, partitions=args.partitions,
                      seconds=args.seconds, concurrency=args.concurrency, max_lag=args.max_lag,
                      n_samples=args.n_samples, take_n=args.take_n, step_ms=args.step_ms, gen_ms=args.gen_ms,
                      seed=seed, fallback_s=args.fallback_s, rule=rule, churn=args.churn,
                      churn_node=args.churn_node) for i, (mode, size, rule) in enumerate(combos)]


class Say:
    """Progress lines with the elapsed time."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self._lock:
            print(f"[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)


def run_phases(specs: list[PhaseSpec], bootstrap: str, run_dir: Path, say: Say, broker: BrokerRequests | None,
               cluster: Cluster | None = None, client_file: Path | None = None
               ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    results: list[dict[str, Any]] = []
    calibration: dict[str, float] | None = None
    for spec in specs:
        say(f"phase {spec.index + 1}/{len(specs)}: {spec.label} ({spec.producers} producers in "
            f"{-(-spec.producers // spec.per_process)} processes, {spec.partitions} partitions)")
        phase = Phase(spec, bootstrap, run_dir, say, calibration, broker, cluster, client_file)
        try:
            result = phase.run()
        except FleetError as exc:  # this phase could not run; the next ones may (each has its own namespace)
            phase.teardown()
            results.append({"label": spec.label, "error": str(exc)})
            say(f"{spec.label}: FAILED: {exc}")
            continue
        except BaseException:
            phase.teardown()
            raise
        finally:
            calibration = phase.calibration
        results.append(result)
        c = result["checks"]
        say(f"{spec.label}: {result['groups_per_s']:.0f} groups/s, lag max {result['lag']['max']} (bound "
            f"{result['lag']['bound']}), gate {result['backpressure']['gate_requests_per_s']:.0f} requests/s; "
            f"{c['loaded']} loaded, {c['lost']} lost, {c['duplicated']} duplicated, audit "
            f"{'ok' if c['audit_ok'] else 'FAILED'}")
    return results, calibration or {}


def measure_idle_control(bootstrap: str, sizes: str, say: Say, client_file: Path | None = None
                         ) -> list[dict[str, Any]]:
    """Idle NS.control watchers' Fetch requests per second, at each size (`tests.fleet._control_idle`)."""
    out = []
    for n in (int(x) for x in sizes.split(",") if x.strip()):
        figures = measure(KafkaConfig.load(bootstrap, client_file), n, replication_factor=3)
        say(f"idle NS.control watchers x{n} ({figures['watchers_running']} reporting): {figures['fetch_per_s']:.0f} "
            f"Fetch/s ({figures['fetch_per_s_per_watcher']:.2f} per watcher)")
        out.append(figures)
    return out


def open_broker_requests(cluster: Cluster, say: Say) -> BrokerRequests | None:
    """The brokers' JMX request counters (`tests.fleet._broker_metrics`), or None when no JDK can read them."""
    try:
        broker = BrokerRequests([cluster.pid(node) for node in cluster.nodes])
    except (RuntimeError, OSError) as exc:
        say(f"broker request metrics unavailable ({exc}); only client-side counts will be reported")
        return None
    say("reading the brokers' request counters over JMX (tests/fleet/BrokerRequests.java)")
    return broker


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # librdkafka logs every passing broker condition (a coordinator still loading at start); the checks judge.
    logging.getLogger("librdkafka").setLevel(logging.ERROR)
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    command = "python -m tests.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    say = Say()
    specs = plan(args, seed)
    run_dir = Path(tempfile.mkdtemp(prefix="fleet-", dir="/tmp"))
    port = args.port or free_port(3)
    cluster = Cluster(BrokerSpec(port=port, nodes=3, data_dir=run_dir / "broker", heap_mb=512, tls=args.tls,
                                 sasl=args.sasl))
    # Against a TLS or SASL cluster every client, the producer processes' too, uses the admin file start writes.
    client_file = cluster.spec.data_dir / "admin.properties" if args.tls or args.sasl else None
    security = " over ".join(m for m in ("SASL/SCRAM" if args.sasl else "", "TLS" if args.tls else "") if m)
    say(f"seed {seed}; {len(specs)} phase(s); starting a 3-node cluster{' with ' + security if security else ''} "
        f"in {run_dir}")
    results: list[dict[str, Any]] = []
    calibration: dict[str, float] = {}
    idle: list[dict[str, Any]] = []
    bootstrap = "-"
    broker: BrokerRequests | None = None
    error = None
    try:
        bootstrap = cluster.start()
        say(f"cluster up on {bootstrap}")
        # --churn kills a node: the JMX reader holds the JVMs' pids, so the brokers' counts are left out there.
        broker = None if args.churn else open_broker_requests(cluster, say)
        results, calibration = run_phases(specs, bootstrap, run_dir, say, broker, cluster, client_file)
        idle = measure_idle_control(bootstrap, args.idle_watchers, say, client_file)
    except KeyboardInterrupt:
        error = "interrupted (Ctrl-C)"
    except BrokerError as exc:
        error = f"the cluster did not start: {exc}"
    except Exception:  # noqa: BLE001 - the report must still be written and the cluster stopped
        error = traceback.format_exc()
    finally:
        if broker is not None:
            broker.close()
        try:
            cluster.stop()
        except Exception:  # noqa: BLE001
            error = (error or "") + "\ncluster stop: " + traceback.format_exc()
    # The bound is the contract for today's rule (DESIGN.md, "Fleet"); the old rule's phases are there to compare.
    ok = error is None and len(results) == len(specs) and all(
        r.get("checks", {}).get("ok") and (r["lag"]["within_bound"] or r["spec"]["rule"] == "old") for r in results)
    run = {"command": command, "seed": seed, "bootstrap": bootstrap, "security": security or "plaintext",
           "partitions": args.partitions,
           "calibration": calibration, "calibration_total": sum(calibration.values()), "phases": results,
           "control_idle": idle, "error": error, "ok": ok, "run_dir": str(run_dir)}
    json_path, png = write(run, args.out)
    if results:
        print("\n" + render(run), flush=True)
    if error:
        print(f"error: {error}", flush=True)
    print(f"report: {json_path}" + (f", {png}" if png else ""), flush=True)
    if ok and not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        print(f"data dir and logs kept in {run_dir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
