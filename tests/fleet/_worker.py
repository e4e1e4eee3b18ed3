"""One fleet process: M `RolloutProducer`s on one asyncio loop, instrumented, reporting JSON lines.

Run by the driver as ``python -m tests.fleet._worker '<json spec>'``. It writes one JSON object per line on
stdout: ``{"kind": "tick", ...}`` every `report_s` (counters summed over its producers, the loop lag of
the interval, the lag-gate call counts and the control watchers' request counts, both cumulative), and
``{"kind": "final", ...}`` once every producer has stopped (with the loop lag of the whole run and any
producer error). A line ``stop`` on stdin (or SIGTERM) stops every producer gracefully: in-flight groups
finish and publish, prompts are committed. Logs go to stderr (the driver sends them to a file).

Generation is latency-modelled: each group sleeps a uniform draw from `gen_ms` (the time an inference
server would take) and returns `n_samples` tiny completions (2 tokens); the reward is the sample's index
over n, so a group's rewards always differ and the trainer's "all rewards equal" filter keeps it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.producers.gate import LagGate

from tests.fleet._probes import CONTROL_WATCH_PREFIX, ClientStats, LagReadCounter, LoopLagProbe, percentiles_ms

log = logging.getLogger("tests.fleet.worker")


class LatencyModel:
    """An async generate function: sleeps U(lo, hi) ms, returns n two-token completions."""

    def __init__(self, lo_ms: float, hi_ms: float, seed: int) -> None:
        self.lo_s, self.hi_s = lo_ms / 1000.0, hi_ms / 1000.0
        self._rng = random.Random(seed)

    async def __call__(self, prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        await asyncio.sleep(self._rng.uniform(self.lo_s, self.hi_s))
        return [{"text": f"a{i}", "tokens": [7, i], "logprobs": [-0.5, -0.25], "finish_reason": "stop"}
                for i in range(n)]


def index_reward(n: int) -> Any:
    def reward(prompt: dict[str, Any], completion: dict[str, Any]) -> float:
        return completion["tokens"][-1] / n
    return reward


def settings_for(spec: dict[str, Any], producer_id: str) -> ProducerSettings:
    """The producer settings of one fleet member; `backpressure` only where this tree has the field."""
    kwargs: dict[str, Any] = dict(
        namespace=spec["namespace"], n_samples=spec["n_samples"], concurrency=spec["concurrency"],
        max_lag=spec["max_lag"], trainer_group=spec["trainer_group"], producer_id=producer_id,
        max_new_tokens=2, summary_interval_s=0.0, startup_timeout_s=spec.get("startup_timeout_s", 60.0),
        drain_timeout_s=30.0)
    if "backpressure" in {f.name for f in dataclasses.fields(ProducerSettings)}:
        kwargs["backpressure"] = spec["backpressure"]
        if spec.get("fallback_s"):
            kwargs["lag_fallback_s"] = spec["fallback_s"]
    elif spec["backpressure"] != "poll":
        raise SystemExit("ProducerSettings has no `backpressure` field in this tree: only --backpressure poll works")
    return ProducerSettings(**kwargs)


def use_old_rule() -> None:
    """The gate rule before issue 25, for a side-by-side phase: every producer compares the trainer group's
    lag with the whole max_lag, and no share holds it back."""
    def old_is_open(gate: LagGate) -> bool:
        return gate.estimate <= gate.max_lag

    LagGate.is_open = old_is_open  # type: ignore[method-assign]  # this worker process only


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        if spec.get("rule") == "old":
            use_old_rule()
        self.counter = LagReadCounter().install()
        self.control = ClientStats(lambda g: g.startswith(CONTROL_WATCH_PREFIX), interval_s=1.0).install()
        self.probe = LoopLagProbe(spec.get("probe_s", 0.02))
        self.all_lags: list[float] = []
        kafka = KafkaConfig.load(spec["bootstrap"], Path(spec["kafka_config"]) if spec.get("kafka_config") else None)
        base = spec["first_index"]
        lo_ms, hi_ms = spec["gen_ms"]
        self.producers = [
            RolloutProducer(LatencyModel(lo_ms, hi_ms, seed=spec["seed"] * 100_003 + base + i),
                            settings_for(spec, f"fleet-{spec['phase']}-{base + i:04d}"), kafka=kafka,
                            reward=index_reward(spec["n_samples"]))
            for i in range(spec["count"])]
        self.errors: list[str] = []
        self.started_at = time.monotonic()

    def emit(self, kind: str, **extra: Any) -> None:
        totals = {"groups_ok": 0, "groups_failed": 0, "prompts_taken": 0, "in_flight": 0, "buffered": 0,
                  "paused": 0, "queue_full_waits": 0}
        pushed = read = 0.0
        for producer in self.producers:
            s = producer.stats()
            totals["groups_ok"] += s.groups_ok
            totals["groups_failed"] += s.groups_failed
            totals["prompts_taken"] += s.prompts_taken
            totals["in_flight"] += s.in_flight
            totals["buffered"] += s.buffered
            totals["paused"] += int(s.paused)
            totals["queue_full_waits"] += s.queue_full_waits
            pushed += _sample(producer, "pushed")
            read += _sample(producer, "read")
        lags = self.probe.drain()
        self.all_lags.extend(lags)
        line = {"kind": kind, "t": time.time(), "proc": self.spec["proc"], **totals,
                "running": sum(1 for p in self.producers if p._parts is not None),  # noqa: SLF001 - started yet?
                "loop_lag_ms": percentiles_ms(lags), "loop_lag_s": [round(x, 5) for x in lags],
                "lag_calls": self.counter.snapshot(),
                "control_requests": self.control.totals(), "control_clients": self.control.clients(),
                "lag_updates": {"pushed": pushed, "read": read}, "errors": self.errors, **extra}
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        # Every producer hands blocking calls to the loop's default executor (asyncio.to_thread): size it
        # for M producers, not for one (the default is min(32, cpus + 4) threads for the whole process).
        loop.set_default_executor(ThreadPoolExecutor(max_workers=max(16, 2 * len(self.producers)),
                                                     thread_name_prefix="fleet-exec"))
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        loop.add_reader(sys.stdin.fileno(), self._on_stdin)
        self.probe.start()
        tasks = [asyncio.create_task(self._run_one(p), name=f"producer-{i}") for i, p in enumerate(self.producers)]
        reporter = asyncio.create_task(self._report())
        await asyncio.gather(*tasks)
        reporter.cancel()
        self.probe.stop()
        self.all_lags.extend(self.probe.drain())
        self.emit("final", loop_lag_run_ms=percentiles_ms(self.all_lags),
                  seconds=time.monotonic() - self.started_at)

    async def _run_one(self, producer: RolloutProducer) -> None:
        try:
            await producer.run()
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which fails the run
            self.errors.append(f"{producer.producer_id}: {type(exc).__name__}: {exc}")
            log.error("producer %s failed:\n%s", producer.producer_id, traceback.format_exc())

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(self.spec.get("report_s", 1.0))
            self.emit("tick")

    def _on_stdin(self) -> None:
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            asyncio.get_running_loop().remove_reader(sys.stdin.fileno())
            self.stop()

    def stop(self) -> None:
        for producer in self.producers:
            producer.stop()


def _sample(producer: RolloutProducer, source: str) -> float:
    value = producer.registry.get_sample_value("rollstream_producer_lag_updates_total", {"source": source})
    return float(value or 0.0)


def main() -> int:
    spec = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
    asyncio.run(Worker(spec).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
