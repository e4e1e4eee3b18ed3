"""A trainer (and a producer) under steady load, resident memory sampled: ``make soak`` (docs/benchmarks.md).

``python -m tests.bench.soak [BOOTSTRAP] [--minutes 30] [--rate 400] [--partitions 3] [--step 64] [--every 60]
[--producer raw|rollstream] [--dedupe-window OFFSETS,SECONDS] [--out soak-out] [--python PY]``

Without BOOTSTRAP: ``ROLLSTREAM_BOOTSTRAP_SERVERS``, else a local broker started (and stopped) here, as ``make
bench`` does. The trainer is ``rollstream take -n STEP --steps 0`` (its default dedupe window, or
``--dedupe-window``: a shorter one fills within the run, so its plateau shows) on a fresh namespace. What feeds it:
``raw`` (default) publishes small groups (4 samples of 16 tokens, unique ids) from this process at ``--rate``
groups/s, the highest rate a trainer can be fed here; ``rollstream`` runs one ``rollstream produce`` process with
an instant generate function and reward (`instant`, `reward` below) as fast as its backpressure lets it (prompts
loaded for 4x ``--rate``), and samples its RSS too. Every ``--every`` s the trainer's (and the producer's) RSS
(``VmRSS``) and the groups committed so far are sampled; at the end ``OUT/soak.json`` and ``OUT/soak.md`` hold the
samples and, per process, the warm-up RSS (the first sample after 60 s), the highest RSS after it, and the growth
per 100,000 groups taken after warm-up. ``--python PY`` runs the trainer and producer with another interpreter
(another checkout's venv: before and after). Not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.kafka_io import committed_offsets, reader
from rollstream.schemas import encode

from tests.chaos._rss import rss_kib
from tests.records import make_group

GROUP = "soak"
WARMUP_S = 60.0


async def instant(prompt: dict, n: int, sampling_params: dict) -> list[dict]:
    """A generate function that costs nothing: `n` completions of 16 tokens."""
    return [{"text": f"answer {j}", "tokens": list(range(16)), "logprobs": [-0.5] * 16, "finish_reason": "stop"}
            for j in range(n)]


def reward(prompt: dict, completion: dict) -> float:
    """Differs within a group (the trainer's "all rewards equal" filter keeps it)."""
    return float(completion["text"][-1])


def _publish(config: KafkaConfig, names: TopicNames, rate: float, stop: threading.Event) -> None:
    """Unique small groups at `rate` per second until `stop` (thread ``soak-publisher``)."""
    producer = Producer({**config.producer(), "linger.ms": 20})
    started, sent = time.monotonic(), 0
    while not stop.is_set():
        due = int((time.monotonic() - started) * rate)
        while sent < due:
            g = make_group(f"s{sent}", rewards=(0.0, 1.0, 0.5, 0.25), response_len=16)
            try:
                producer.produce(names.rollouts, encode(g), key=g.group_id.encode())
                sent += 1
            except BufferError:
                producer.poll(0.05)
        producer.poll(0.05)
    producer.flush(30)


def _taken(config: KafkaConfig, names: TopicNames, partitions: int) -> int:
    with reader(config, GROUP) as consumer:
        found = committed_offsets(consumer, names.rollouts, list(range(partitions)), timeout=10)
    return sum(o or 0 for o in found.values())


def _rollstream(python: str, *args: str, **kw: Any) -> subprocess.Popen:
    return subprocess.Popen([python, "-m", "rollstream", *args], **kw)


def _start_producer(a: argparse.Namespace, names: TopicNames, out: Path) -> subprocess.Popen:
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(10_000)))
    epochs = max(1, int(4 * a.rate * a.minutes * 60 / 10_000) + 1)
    common = ["--namespace", names.namespace, "--bootstrap-servers", a.bootstrap]
    subprocess.run([sys.executable, "-m", "rollstream", "prompts", "load", str(prompts), "--epochs", str(epochs),
                    *common], check=True, capture_output=True)
    return _rollstream(a.python, "produce", "--generate", "tests.bench.soak:instant",
                       "--reward", "tests.bench.soak:reward",
                       "--n-samples", "4", "--concurrency", "256", "--max-lag", "4000", "--trainer-group", GROUP,
                       "--producer-id", "soak-p0", *common, stdout=subprocess.DEVNULL,
                       stderr=(out / "producer.log").open("w"))


def _summary(samples: list[dict], role: str) -> dict[str, float] | None:
    points = [(s["t"], s["taken"], s[role]) for s in samples if s.get(role)]
    warm = [p for p in points if p[0] >= WARMUP_S]
    if len(warm) < 2 or warm[-1][1] - warm[0][1] < 1000:
        return None
    (_, g0, r0), (_, g1, r1) = warm[0], warm[-1]
    return {"warmup_mib": round(r0 / 1024, 1), "highest_after_mib": round(max(r for *_, r in warm) / 1024, 1),
            "last_mib": round(r1 / 1024, 1),
            "growth_mib_per_100k_groups": round((r1 - r0) / 1024 / max(g1 - g0, 1) * 1e5, 2)}


def _report(a: argparse.Namespace, samples: list[dict], out: Path) -> None:
    roles = ["trainer"] + (["producer"] if a.producer == "rollstream" else [])
    summary = {role: _summary(samples, role) for role in roles}
    (out / "soak.json").write_text(json.dumps({"settings": {k: str(v) for k, v in vars(a).items()},
                                               "summary": summary, "samples": samples}, indent=1))
    window = f", dedupe window {a.dedupe_window}" if a.dedupe_window else ""
    lines = [f"# Soak: {a.minutes} min, {a.producer} feed at {a.rate:g} groups/s, {a.partitions} partitions, "
             f"steps of {a.step}{window}", "",
             "| s | groups taken | groups/s | " + " | ".join(f"{r} RSS MiB" for r in roles) + " |",
             "|---:|---:|---:|" + "---:|" * len(roles)]
    for prev, s in zip([None, *samples], samples, strict=False):
        rate = "" if prev is None else f"{(s['taken'] - prev['taken']) / max(s['t'] - prev['t'], 1e-9):.0f}"
        lines.append(f"| {s['t']:.0f} | {s['taken']} | {rate} | "
                     + " | ".join(f"{(s.get(r) or 0) / 1024:.1f}" for r in roles) + " |")
    lines += ["", "| process | warm-up RSS (MiB, first sample after 60 s) | highest after | last | "
              "growth (MiB per 100k groups) |", "|---|---:|---:|---:|---:|"]
    for role, sm in summary.items():
        if sm:
            lines.append(f"| {role} | {sm['warmup_mib']} | {sm['highest_after_mib']} | {sm['last_mib']} | "
                         f"{sm['growth_mib_per_100k_groups']:+} |")
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("bootstrap", nargs="?", help="a broker to use (default: ROLLSTREAM_BOOTSTRAP_SERVERS, else "
                        "a local broker started and stopped here)")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the trainer takes (default: 30)")
    parser.add_argument("--rate", type=float, default=400.0, help="groups/s the raw feed publishes (default: 400)")
    parser.add_argument("--partitions", type=int, default=3, help="partitions of the namespace (default: 3)")
    parser.add_argument("--step", type=int, default=64, help="groups per trainer step (default: 64)")
    parser.add_argument("--every", type=float, default=60.0, help="seconds between RSS samples (default: 60)")
    parser.add_argument("--producer", choices=("raw", "rollstream"), default="raw",
                        help="what feeds the trainer: groups published from here at --rate, or a rollstream "
                        "produce process as fast as its backpressure lets it (its RSS sampled too)")
    parser.add_argument("--dedupe-window", metavar="OFFSETS,SECONDS",
                        help="the trainer's dedupe window (rollstream take --dedupe-window; default: its own)")
    parser.add_argument("--out", type=Path, default=Path("soak-out"), help="where soak.md and soak.json go")
    parser.add_argument("--python", default=sys.executable, help="the interpreter running the trainer and producer")
    a = parser.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.bootstrap:
        soak(a)
        return
    from tests.bench.__main__ import _broker

    with _broker(lambda msg: print(msg, file=sys.stderr)) as (bootstrap, _):
        a.bootstrap = bootstrap
        soak(a)


def soak(a: argparse.Namespace) -> None:
    """Run the soak `a` describes against ``a.bootstrap``; write the report."""
    config = KafkaConfig(bootstrap_servers=a.bootstrap)
    names = TopicNames(f"soak-{uuid.uuid4().hex[:6]}")
    create_topics(TopicPlan(names=names, partitions=a.partitions), config)
    stop = threading.Event()
    feeder: threading.Thread | None = None
    producer: subprocess.Popen | None = None
    if a.producer == "raw":
        feeder = threading.Thread(target=_publish, args=(config, names, a.rate, stop), name="soak-publisher")
        feeder.start()
    else:
        producer = _start_producer(a, names, a.out)
    window = ["--dedupe-window", a.dedupe_window] if a.dedupe_window else []
    trainer = _rollstream(a.python, "take", "-n", str(a.step), "--steps", "0", "--group", GROUP, "--namespace",
                          names.namespace, "--bootstrap-servers", a.bootstrap, *window, stdout=subprocess.DEVNULL,
                          stderr=(a.out / "trainer.log").open("w"))
    samples: list[dict] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < a.minutes * 60 and trainer.poll() is None:
            time.sleep(max(0.0, a.every - (time.monotonic() - started) % a.every))
            samples.append({"t": round(time.monotonic() - started, 1), "taken": _taken(config, names, a.partitions),
                            "trainer": rss_kib(trainer.pid),
                            "producer": None if producer is None else rss_kib(producer.pid)})
            print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
    finally:
        stop.set()
        for proc in (trainer, producer):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
        if feeder is not None:
            feeder.join()
    _report(a, samples, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
