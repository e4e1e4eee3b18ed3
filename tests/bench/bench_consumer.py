"""Trainer-side throughput, side by side in one run: `RolloutConsumer.take(n)` (decode, filters, dedupe,
manifest, commit per step) vs a raw confluent-kafka consumer reading the same records, same bytes.

Both read the same topic from offset 0 with fresh consumer groups, so the broker serves the same bytes
from the same page cache; each side runs `REPEATS` times, alternating, and its best run counts. Take latency
percentiles are over every take of the best take() run.

Run alone: ``python -m tests.bench.bench_consumer`` (uses ``ROLLSTREAM_BOOTSTRAP_SERVERS``; prints a
markdown table). ``make bench`` calls `run`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition

from consumers import RolloutConsumer
from infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from schemas import Sample, ScoredGroup, encode, make_group_id

GROUP_BYTES = 100 * 1024
SAMPLES = 8
PARTITIONS = 3
REPEATS = 4  # alternating runs per side; the best of each counts (the machine is shared and noisy)


@dataclass(frozen=True)
class _Run:
    seconds: float
    groups: int
    nbytes: int
    latencies: tuple[float, ...] = ()


def make_groups(count: int) -> list[bytes]:
    """`count` encoded groups of ~100 KB: 8 samples of random tokens with logprobs, rewards varying."""
    rng = np.random.default_rng(0)
    tokens = (GROUP_BYTES - 1024) // (SAMPLES * 8)  # 4 bytes token + 4 bytes logprob
    out = []
    for i in range(count):
        samples = [Sample(tokens=rng.integers(0, 150_000, tokens), logprobs=-rng.random(tokens, dtype=np.float32),
                          reward=float(j % 2), weight_versions=(1,)) for j in range(SAMPLES)]
        out.append(encode(ScoredGroup(group_id=make_group_id(f"b{i}", 0), prompt_id=f"b{i}", epoch=0,
                                      prompt_tokens=rng.integers(0, 150_000, 128), samples=samples,
                                      started_at_ms=0, finished_at_ms=1)))
    return out


def _publish(config: KafkaConfig, names: TopicNames, payloads: list[bytes]) -> None:
    producer = Producer(config.producer())
    for i, value in enumerate(payloads):
        producer.produce(names.rollouts, value, key=make_group_id(f"b{i}", 0))
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("bench: publishing the groups did not finish in 120 s")


def _raw(config: KafkaConfig, names: TopicNames, count: int) -> _Run:
    consumer = Consumer(config.consumer(f"bench-raw-{uuid.uuid4().hex[:8]}", {"enable.partition.eof": False}))
    consumer.assign([TopicPartition(names.rollouts, p, 0) for p in range(PARTITIONS)])
    got = nbytes = 0
    started = time.perf_counter()
    while got < count:
        for msg in consumer.consume(min(500, count - got), timeout=5.0):
            if msg.error() is None:
                got += 1
                nbytes += len(msg.value())
    seconds = time.perf_counter() - started
    consumer.close()
    return _Run(seconds, got, nbytes)


def _take(config: KafkaConfig, names: TopicNames, count: int, n: int) -> _Run:
    with RolloutConsumer(config=config, group_id=f"bench-take-{uuid.uuid4().hex[:8]}",
                         namespace=names.namespace) as consumer:
        consumer.position()  # connect and read manifests before the clock starts, as a trainer does at startup
        latencies, got = [], 0
        started = time.perf_counter()
        while got < count:
            t0 = time.perf_counter()
            batch = consumer.take(min(n, count - got), timeout=30)
            latencies.append(time.perf_counter() - t0)
            got += len(batch)
        seconds = time.perf_counter() - started
        nbytes = int(consumer.metrics.bytes_taken._value.get())
    return _Run(seconds, got, nbytes, tuple(latencies))


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames], *, groups: int = 1000,
        n: int = 256) -> list[tuple[str, str]]:
    """Rows (figure, value): take() vs raw groups/s and MB/s, their ratio, take latency p50/p99.

    `names_factory(partitions=P)` must return a fresh namespace whose topics exist.
    """
    names = names_factory(partitions=PARTITIONS)
    payloads = make_groups(groups)
    _publish(config, names, payloads)
    raws, takes = [], []
    for _ in range(REPEATS):
        raws.append(_raw(config, names, groups))
        takes.append(_take(config, names, groups, n))
    raw = min(raws, key=lambda r: r.seconds)
    take = min(takes, key=lambda r: r.seconds)
    ms = np.array(take.latencies) * 1000
    mean_kb = sum(map(len, payloads)) / len(payloads) / 1024
    return [
        ("consumer workload", f"{groups} groups of {mean_kb:.0f} KB on {PARTITIONS} partitions, take(n={n})"),
        ("take() groups/s", f"{take.groups / take.seconds:,.0f}"),
        ("take() MB/s", f"{take.nbytes / take.seconds / 1e6:,.1f}"),
        ("raw confluent-kafka groups/s", f"{raw.groups / raw.seconds:,.0f}"),
        ("raw confluent-kafka MB/s", f"{raw.nbytes / raw.seconds / 1e6:,.1f}"),
        ("ratio take() / raw (target >= 0.8)", f"{raw.seconds / take.seconds:.2f}"),
        (f"take({n}) latency p50 ms", f"{np.percentile(ms, 50):.1f}"),
        (f"take({n}) latency p99 ms", f"{np.percentile(ms, 99):.1f}"),
    ]


def _standalone_names(config: KafkaConfig) -> Callable[..., TopicNames]:
    def make(partitions: int = PARTITIONS) -> TopicNames:
        names = TopicNames(f"bench-consumer-{uuid.uuid4().hex[:8]}")
        create_topics(TopicPlan(names=names, partitions=partitions), config)
        return names
    return make


if __name__ == "__main__":
    cfg = KafkaConfig(client_id="rollstream-bench")
    print("| figure | value |\n|---|---|")
    for name, value in run(cfg, _standalone_names(cfg)):
        print(f"| {name} | {value} |")
