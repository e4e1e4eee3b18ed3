"""``make bench``: every performance figure of rollstream, each a side-by-side ratio measured in one run.

Usage: ``python -m tests.bench [--out bench-report.md] [--only pipeline,codec,...]``. The ``verl`` part runs
only in the verl venv (``.venv-verl/bin/python -m tests.bench --only verl``; `tests.bench.bench_verl`).

Uses ``ROLLSTREAM_BOOTSTRAP_SERVERS`` when set; else starts a local broker on a free port with a temporary
data dir and stops it at the end, also on error or Ctrl-C. Progress goes to stderr; the markdown report is
written to ``--out`` and printed on stdout. Every part creates its own namespaces, deleted at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rollstream.infra import BOOTSTRAP_ENV, KafkaConfig, TopicNames

from tests.bench import (
    bench_baseline,
    bench_codec,
    bench_consumer,
    bench_conversions,
    bench_pipeline,
    bench_producer,
    bench_tls,
)
from tests.bench._common import NamesFactory, Rows, delete_topics, topic_factory
from tests.bench._report import Part, machine_facts, render

log = logging.getLogger("tests.bench")


@dataclass(frozen=True)
class _Spec:
    key: str
    title: str
    how: str
    run: Callable[[KafkaConfig, NamesFactory, Callable[[str], None]], Rows]


def _specs() -> list[_Spec]:
    pipe_sizes = ", ".join(f"{b // 1024} KB x {n}" for b, n in bench_pipeline.SIZES)
    return [
        _Spec("pipeline", "Pipeline throughput: produce -> take vs raw confluent-kafka",
              f"prompts -> `RolloutProducer` (instant generate, no reward) -> NS.rollouts -> "
              f"`take({bench_pipeline.TAKE_N})` "
              f"(decode, dedupe, manifest + commit per step, `filters=()`), vs a raw confluent-kafka producer thread "
              f"and consumer moving the very bytes the producer publishes (same client config: idempotent, acks=all, "
              f"lz4; no decode, no commit). Group sizes and counts: {pipe_sizes}. Ours is clocked from the "
              f"producer's first prompt to the last take, raw from the first produce to the last record read. "
              f"{bench_pipeline.REPEATS} alternating runs per side and size on fresh topics; ratios of the **best of** "
              f"each side, and the **median** of the ratios of back-to-back pairs.",
              lambda c, f, p: bench_pipeline.run(c, f, progress=p)),
        _Spec("tls", "What TLS costs: the pipeline over plaintext vs over --tls, raw confluent-kafka alike",
              f"The pipeline part's workload ({', '.join(f'{b // 1024} KB x {n}' for b, n in bench_tls.SIZES)}) on "
              "two private one-node local brokers started alike, one plaintext and one with `broker start --tls` "
              "(SSL listeners, a local CA, hostname verification on, TLS 1.2+ as librdkafka and the JVM "
              f"negotiate); {bench_tls.REPEATS} rounds of the four runs alternating, on fresh topics, **best of** "
              "each. TLS / plaintext is throughput over TLS divided by throughput over plaintext (1.00: free).",
              lambda c, f, p: bench_tls.run(c, f, progress=p)),
        _Spec("codec", "Codec: packed single-object Avro (schema v4 vs v3) vs Avro arrays vs memory copy",
              "One ScoredGroup of 8 x 4096 tokens + logprobs encoded/decoded by rollstream's codec (packed "
              "little-endian bytes; decode includes building every `Sample`), written with schema v4 and, the "
              "same group, with v3 (decoded through its upgrader, as old records are read; v3 and v4 timed in "
              f"{bench_codec.ROUNDS} alternating rounds, best of each; v4 must stay within 20% of v3), and a v4 "
              "group whose samples all carry a loss mask and two version spans; vs fastavro with the same "
              "tokens as Avro `int`/`float` arrays, vs `bytes()` "
              "of the same encoded bytes. Each is timed over >= 1 s after a warm-up, in the same process, "
              "one after another; MB/s is payload bytes (tokens + logprobs) per second.",
              lambda c, f, p: bench_codec.run()),
        _Spec("consumer", "Trainer consumer: take() vs raw confluent-kafka",
              f"{bench_consumer.GROUPS} pre-published ~100 KB groups read from offset 0 by "
              f"`take({bench_consumer.TAKE_N})` (decode, filters, dedupe, "
              "manifest, commit per step), by a raw confluent-kafka consumer (bytes only), and by a raw consumer "
              f"that also runs `rollstream.schemas.decode` on each record. Same topic and page cache, fresh groups, "
              f"{bench_consumer.REPEATS} alternating rounds; ratios of the **best of** each side, and the **median** "
              "of per-round ratios. Each take is `take(n, commit=False)` then `commit(batch)` (what `take(n)` does), "
              "timed apart to show the commit's share. Latencies: every take of the best take() run.",
              lambda c, f, p: bench_consumer.run(c, f)),
        _Spec("producer", "Rollout producer: RolloutProducer vs raw confluent-kafka, event-loop lag",
              "1000 ~100 KB groups from an instant generate function through `RolloutProducer` (intake, group "
              "building, encoding, publishing, prompt commits; concurrency 64) vs a raw confluent-kafka producer "
              f"sending the same encoded records (same config), all queued at once; {bench_producer.REPEATS} "
              "alternating runs per side on fresh topics, **best of** each. Loop lag: how late a 10 ms timer "
              "fires on the producer's loop, while publishing flat out and while paused by backpressure "
              "(max_lag 8, no trainer), p99 over the window.",
              lambda c, f, p: bench_producer.run(c, f)),
        _Spec("baseline", "The original in-process queue design vs rollstream",
              "A faithful small reproduction of the buggy original of `docs/origin.md` "
              "(asyncio worker thread topping up `concurrency` generate tasks, done-callback doing a blocking "
              "`queue.Queue(maxsize).put`, `generate_rollout` draining everything and returning "
              "`sorted(...)[:target]`; top-up poll 50 ms instead of the original's 1 s, in its favour) vs "
              "`RolloutProducer` + `take(target)` on the same synthetic generate function. Delivery: groups "
              "generated, delivered and lost, checked by id; each side runs once, until its prompts are used up. "
              "Freeze: the original with a queue of 8 and 500 ms training steps, rollstream with max_lag 8; "
              "longest stall of a 10 ms timer on the generation loop.",
              lambda c, f, p: bench_baseline.run(c, f, progress=p)),
        _Spec("conversions", "What the TRL and slime adapters' conversions cost a step",
              f"One step's records ({bench_conversions.GROUPS} groups x {bench_conversions.RESPONSES} responses of "
              f"1-{bench_conversions.RESPONSE_MAX} tokens with logprobs and loss masks, "
              f"{bench_conversions.PROMPT}-token prompts) decoded, then turned into TRL's `RolloutSample`s "
              "(`to_rollout_samples`) and slime's `Sample`s (`to_slime_group`, slime's stand-in); best of "
              f"{bench_conversions.ROUNDS}. No broker: the take and commit are the consumer part's.",
              lambda c, f, p: bench_conversions.run()),
        _Spec("verl", "verl's transport: acknowledged puts/s side by side, a 32 x 8 trainer step's take and rebuild",
              "verl 0.9.1's rollouter puts (cloudpickled RolloutSamples of 8 responses, 1024 + 2048 token "
              "widths, 64 at once) through `VerlRolloutQueue.put_sample`, each returning once acknowledged, in "
              "this checkout and, as a child process, in the checkout whose interpreter "
              "`ROLLSTREAM_VERL_BASE_PYTHON` names (main b5c9eaa's for the figure in docs/benchmarks.md); 3 "
              "alternating runs a side, best of each. Then `VerlTrainerQueue` steps of 32 groups as verl's "
              "`_get_samples_from_queue` reads them: take, rebuild (decode + hand-over + verl's unpickle) and "
              "verl's `assemble_batch_from_rollout_samples`, best of 3 steps.",
              lambda c, f, p: _bench_verl().run(c, f, p)),
    ]


def _bench_verl():  # noqa: ANN202 - the module, imported only when its part runs (it needs the verl venv)
    if importlib.util.find_spec("verl") is None:
        raise SystemExit("the verl part needs verl: run it as .venv-verl/bin/python -m tests.bench --only verl")
    from tests.bench import bench_verl

    return bench_verl


@contextlib.contextmanager
def _broker(progress: Callable[[str], None]) -> Iterator[tuple[str, str]]:
    """(bootstrap, Kafka version) of ROLLSTREAM_BOOTSTRAP_SERVERS, or of a local broker started here."""
    external = os.environ.get(BOOTSTRAP_ENV)
    if external:
        yield external, "external broker (its version is not reported by the Kafka protocol)"
        return
    from rollstream.infra.broker import BrokerSpec, ensure_kafka_jars, free_port, start_broker, stop_broker

    libs = ensure_kafka_jars(progress=progress)
    version = f"Apache Kafka {libs.parent.name.removeprefix('kafka-')} (local KRaft broker started by the bench)"
    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as tmp:
        progress("starting a local Kafka broker")
        bootstrap = start_broker(BrokerSpec(port=free_port(), data_dir=Path(tmp), heap_mb=768), timeout=180)
        try:
            yield bootstrap, version
        finally:
            stop_broker(Path(tmp))


def _run_parts(specs: list[_Spec], config: KafkaConfig, progress: Progress) -> list[Part]:
    overall = progress.add_task("bench", total=len(specs))
    parts = []
    for spec in specs:
        made: list[TopicNames] = []
        started = time.monotonic()

        def say(msg: str, spec: _Spec = spec) -> None:
            progress.update(overall, description=f"{spec.key}: {msg}")

        say("running")
        try:
            rows = spec.run(config, topic_factory(config, made, f"bench-{spec.key}"), say)
        finally:
            delete_topics(config, made)
        parts.append(Part(spec.title, spec.how, rows, time.monotonic() - started))
        progress.advance(overall)
    progress.update(overall, description="done")
    return parts


def main(argv: list[str] | None = None) -> int:
    """Run the bench; write and print the report. Returns the exit status."""
    specs = _specs()
    parser = argparse.ArgumentParser(prog="python -m tests.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-report.md"), help="where to write the report")
    parser.add_argument("--only", default="", help=f"comma-separated parts ({','.join(s.key for s in specs)})")
    args = parser.parse_args(argv)
    with_verl = importlib.util.find_spec("verl") is not None  # `make bench` in the main venv runs without it
    chosen = [s for s in specs if s.key in args.only.split(",") or not args.only and (s.key != "verl" or with_verl)]
    if not chosen:
        parser.error(f"--only {args.only!r} names no part")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    started, load_before = time.monotonic(), os.getloadavg()
    with Progress(*columns, console=console, transient=False) as progress:
        status = progress.add_task("setup", total=None)
        with _broker(lambda msg: progress.update(status, description=msg)) as (bootstrap, kafka_version):
            progress.update(status, description=f"broker {bootstrap}", total=1, completed=1)
            config = KafkaConfig(bootstrap_servers=bootstrap, client_id="rollstream-bench")
            parts = _run_parts(chosen, config, progress)
    facts = machine_facts(kafka_version, load_before, os.getloadavg())
    report = render(facts, parts, time.monotonic() - started)
    args.out.write_text(report)
    print(report)
    console.print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
