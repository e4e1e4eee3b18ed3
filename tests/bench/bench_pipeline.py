"""End-to-end throughput, side by side in one run: prompts -> `RolloutProducer` -> NS.rollouts ->
`RolloutConsumer.take(n)`, vs a raw confluent-kafka producer and consumer moving the same encoded bytes.

Ours: prompts are published first (not timed); a `RolloutProducer` with an instant generate function (groups
of 8 samples of random tokens + logprobs, no reward) runs in a thread while the main thread takes
``take(TAKE_N)`` steps (decode, dedupe, manifest to NS.steps, offset commit per step; ``filters=()``
since the groups carry no reward). The clock runs from the producer's first prompt to the last take.
Raw: a confluent-kafka `Producer` (same client config: idempotent, acks=all, lz4) in a thread sends the
records the producer would publish, byte for byte, while a `Consumer` (same config) reads them; the clock
runs from the first produce to the last record read. No decode, no commit: the bare transport.
Each side runs `REPEATS` times per size, alternating, on fresh topics; the best run of each counts.
At the smallest size both sides also run with the producing side in a process of its own, as producers
and trainers are deployed (`tests.bench._pipeline_child`): in one process they share one interpreter
lock, which the raw side, whose work is in librdkafka's C threads, does not feel.

Run alone: ``python -m tests.bench.bench_pipeline`` (uses ``ROLLSTREAM_BOOTSTRAP_SERVERS``).
``make bench`` calls `run`.
"""

from __future__ import annotations

import functools
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import ProducerSettings, RolloutProducer

from tests.bench._common import start_producer, wait_until
from tests.bench.bench_producer import PARTITIONS, SAMPLES, encoded_variants, instant_generator, make_variants
from tests.bench.bench_producer import _prompts as publish_prompts

KB = 1024
SIZES = ((10 * KB, 2000), (100 * KB, 1000), (1024 * KB, 120))  # (group bytes, groups per run)
TAKE_N = 64
CONCURRENCY = 64
REPEATS = 5
VARIANTS = 16
TIMEOUT_S = 120.0


def run_ours(config: KafkaConfig, names: TopicNames, count: int, variants: list[list[dict[str, Any]]]) -> float:
    """Seconds from the producer's first prompt to the last of `count` groups taken."""
    publish_prompts(config, names, count)
    group = f"bench-pipeline-{uuid.uuid4().hex[:8]}"
    settings = ProducerSettings(namespace=names.namespace, n_samples=SAMPLES, concurrency=CONCURRENCY,
                                max_lag=10**9, trainer_group=group, summary_interval_s=0, watch_control=False)
    producer = RolloutProducer(instant_generator(variants), settings, kafka=config)
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=()) as consumer:
        consumer.position()  # assigned and connected before the clock, as a trainer is
        thread, failure = start_producer(producer, "bench-pipeline-producer")
        try:
            started = wait_until(lambda: producer.stats().prompts_taken > 0 or bool(failure), TIMEOUT_S,
                                 "the producer's first prompt")
            taken: set[str] = set()
            while len(taken) < count and not failure:
                taken.update(consumer.take(min(TAKE_N, count - len(taken)), timeout=TIMEOUT_S).group_ids)
            seconds = time.perf_counter() - started
        finally:
            producer.stop()
            thread.join(TIMEOUT_S)
    if failure:
        raise RuntimeError(f"bench: the producer failed: {failure[0]}") from failure[0]
    return seconds


def raw_producer(config: KafkaConfig, names: TopicNames) -> Producer:
    """A raw confluent-kafka producer, connected, with its producer id and metadata (as ours starts)."""
    producer = Producer(config.producer())
    producer.list_topics(names.rollouts, timeout=10)
    producer.produce(names.prompts, b"warm-up")
    producer.flush(10)
    return producer


def _raw_consumer(config: KafkaConfig, names: TopicNames) -> Consumer:
    consumer = Consumer(config.consumer(f"bench-raw-{uuid.uuid4().hex[:8]}", {"enable.partition.eof": False}))
    consumer.assign([TopicPartition(names.rollouts, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    consumer.consume(1, timeout=0.5)  # joins the fetchers; nothing is there yet
    return consumer


def _read_all(consumer: Consumer, count: int) -> None:
    got = 0
    while got < count:
        msgs = consumer.consume(min(500, count - got), timeout=TIMEOUT_S)
        if not msgs:
            raise RuntimeError(f"bench: raw consumer got {got}/{count} records, then nothing for {TIMEOUT_S} s")
        got += sum(1 for m in msgs if m.error() is None)


def _child(side: str, config: KafkaConfig, names: TopicNames, group: str, group_bytes: int,
           count: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.bench._pipeline_child", side, config.bootstrap_servers,
                             names.namespace, group, str(group_bytes), str(count)], stdout=subprocess.PIPE, text=True)


def _first_at(child: subprocess.Popen[str]) -> float:
    out, _ = child.communicate(timeout=TIMEOUT_S)
    if child.returncode != 0:
        raise RuntimeError(f"bench: the producing process exited with {child.returncode}")
    return float(out.strip().splitlines()[-1])


def _ours_apart(config: KafkaConfig, names: TopicNames, count: int, group_bytes: int) -> float:
    """Seconds from the producing process's first prompt to the last of `count` groups taken here."""
    publish_prompts(config, names, count)
    group = f"bench-pipeline-{uuid.uuid4().hex[:8]}"
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=()) as consumer:
        consumer.position()
        child = _child("ours", config, names, group, group_bytes, count)
        taken: set[str] = set()
        while len(taken) < count:
            taken.update(consumer.take(min(TAKE_N, count - len(taken)), timeout=TIMEOUT_S).group_ids)
        done = time.time()
    return done - _first_at(child)


def _raw_apart(config: KafkaConfig, names: TopicNames, count: int, group_bytes: int) -> float:
    """Seconds from the producing process's first produce to the last of `count` records read here."""
    consumer = _raw_consumer(config, names)
    try:
        child = _child("raw", config, names, "unused", group_bytes, count)
        _read_all(consumer, count)
        done = time.time()
    finally:
        consumer.close()
    return done - _first_at(child)


def run_raw(config: KafkaConfig, names: TopicNames, count: int, payloads: list[bytes]) -> float:
    """Seconds from the first produce to the last of `count` records read, raw confluent-kafka."""
    producer = raw_producer(config, names)
    consumer = _raw_consumer(config, names)
    started = time.perf_counter()
    thread = threading.Thread(target=_produce_all, args=(producer, names.rollouts, count, payloads),
                              name="bench-pipeline-raw-producer", daemon=True)
    thread.start()
    try:
        _read_all(consumer, count)
        seconds = time.perf_counter() - started
    finally:
        thread.join(TIMEOUT_S)
        consumer.close()
    return seconds


def _produce_all(producer: Producer, topic: str, count: int, payloads: list[bytes]) -> None:
    for i in range(count):
        while True:
            try:
                producer.produce(topic, payloads[i % len(payloads)], key=f"b{i}#0".encode())
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    producer.flush(TIMEOUT_S)


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames], *,
        sizes: tuple[tuple[int, int], ...] = SIZES, repeats: int = REPEATS,
        progress: Callable[[str], None] | None = None) -> list[tuple[str, str]]:
    """Rows (figure, value): per group size, ours vs raw groups/s and MB/s and their ratio.

    `names_factory(partitions=P)` must return a fresh namespace whose topics exist.
    """
    rows = [("pipeline workload", f"8 samples per group, instant generate, concurrency {CONCURRENCY}, "
                                  f"take(n={TAKE_N}), {PARTITIONS} partitions; best of {repeats} runs per side")]
    for group_bytes, count in sizes:
        variants = make_variants(VARIANTS, group_bytes)
        payloads = encoded_variants(variants)
        mb = sum(len(payloads[i % len(payloads)]) for i in range(count)) / 1e6
        ours, raws = _alternate(repeats, progress, f"{group_bytes // KB} KB groups", names_factory,
                                functools.partial(run_ours, config, count=count, variants=variants),
                                functools.partial(run_raw, config, count=count, payloads=payloads))
        best, raw = min(ours), min(raws)
        label = f"{len(payloads[0]) / KB:,.0f} KB"
        rows += [
            (f"{label}: groups per run", f"{count} ({mb:,.0f} MB)"),
            (f"{label}: rollstream produce -> take groups/s", f"{count / best:,.0f} ({mb / best:,.1f} MB/s)"),
            (f"{label}: raw confluent-kafka groups/s", f"{count / raw:,.0f} ({mb / raw:,.1f} MB/s)"),
            (f"{label}: ratio rollstream / raw: best of each / median of paired runs", ratios(ours, raws)),
        ]
    rows += _apart_rows(config, names_factory, sizes[0], repeats, progress)
    return rows


def _apart_rows(config: KafkaConfig, names_factory: Callable[..., TopicNames], size: tuple[int, int], repeats: int,
                progress: Callable[[str], None] | None) -> list[tuple[str, str]]:
    """The smallest size again, each side's producing half in a process of its own."""
    group_bytes, count = size
    ours, raws = _alternate(repeats, progress, f"{group_bytes // KB} KB groups, producing in its own process",
                            names_factory,
                            functools.partial(_ours_apart, config, count=count, group_bytes=group_bytes),
                            functools.partial(_raw_apart, config, count=count, group_bytes=group_bytes))
    best, raw = min(ours), min(raws)
    label = f"{group_bytes // KB} KB, producing in its own process"
    return [
        (f"{label}: rollstream produce -> take groups/s", f"{count / best:,.0f}"),
        (f"{label}: raw confluent-kafka groups/s", f"{count / raw:,.0f}"),
        (f"{label}: ratio rollstream / raw: best of each / median of paired runs", ratios(ours, raws)),
    ]


def _alternate(repeats: int, progress: Callable[[str], None] | None, what: str,
               names_factory: Callable[..., TopicNames], ours: Callable[[TopicNames], float],
               raw: Callable[[TopicNames], float]) -> tuple[list[float], list[float]]:
    """Seconds of `repeats` runs of each side, alternating (ours, raw, ours, ...), each on fresh topics."""
    out: tuple[list[float], list[float]] = ([], [])
    for attempt in range(repeats):
        if progress is not None:
            progress(f"{what}, run {attempt + 1}/{repeats}")
        out[0].append(ours(names_factory(partitions=PARTITIONS)))
        out[1].append(raw(names_factory(partitions=PARTITIONS)))
    return out


def ratios(ours: list[float], raws: list[float]) -> str:
    """rollstream / raw throughput: of the best run of each, and the median of the paired runs."""
    paired = statistics.median(r / o for r, o in zip(raws, ours, strict=True))
    return f"{min(raws) / min(ours):.2f} / {paired:.2f}"


if __name__ == "__main__":
    from tests.bench._common import run_standalone

    run_standalone(run, "bench-pipeline")
