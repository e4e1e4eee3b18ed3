"""Trainer-side throughput, side by side in one run: `RolloutConsumer.take(n)` (decode, filters, dedupe,
manifest, commit per step) vs a raw confluent-kafka consumer reading the same records, same bytes.

A third side, raw + ``rollstream.schemas.decode`` of every record, is the ceiling for any consumer that decodes with
today's codec: it separates the codec's cost from the consumer's own. All read the same topic from offset
0 with fresh consumer groups (connected before the clock), so the broker serves the same bytes from the
same page cache; each side runs `REPEATS` times, alternating, and its best run counts. Take latency
percentiles are over every take of the best take() run; each take is ``take(n, commit=False)`` followed by
``commit(batch)``, which is what ``take(n)`` does, so the commit's share can be shown on its own.

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
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.schemas import Sample, ScoredGroup, decode, encode, make_group_id

GROUP_BYTES = 100 * 1024
SAMPLES = 8
PARTITIONS = 3
GROUPS = 4000
TAKE_N = 256
REPEATS = 6  # alternating runs per side; the best of each counts (the machine is shared and noisy)


@dataclass(frozen=True)
class _Run:
    seconds: float
    groups: int
    nbytes: int
    latencies: tuple[float, ...] = ()
    commits: tuple[float, ...] = ()


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


def _raw(config: KafkaConfig, names: TopicNames, count: int, decode_each: bool = False) -> _Run:
    """Read `count` records with a plain confluent-kafka consumer (and decode each, with `decode_each`)."""
    consumer = Consumer(config.consumer(f"bench-raw-{uuid.uuid4().hex[:8]}", {"enable.partition.eof": False}))
    consumer.list_topics(names.rollouts, timeout=10)  # connected before the clock, as take()'s consumer is
    consumer.assign([TopicPartition(names.rollouts, p, 0) for p in range(PARTITIONS)])
    got = nbytes = 0
    started = time.perf_counter()
    while got < count:
        for msg in consumer.consume(min(500, count - got), timeout=5.0):
            if msg.error() is None:
                got += 1
                nbytes += len(msg.value())
                if decode_each:
                    decode(msg.value(), ScoredGroup)
    seconds = time.perf_counter() - started
    consumer.close()
    return _Run(seconds, got, nbytes)


def _take(config: KafkaConfig, names: TopicNames, count: int, n: int) -> _Run:
    """`take(n)` until `count` groups; each step's commit (manifest + offsets) is timed on its own."""
    with RolloutConsumer(config=config, group_id=f"bench-take-{uuid.uuid4().hex[:8]}",
                         namespace=names.namespace) as consumer:
        consumer.position()  # connect and read manifests before the clock starts, as a trainer does at startup
        latencies, commits, got = [], [], 0
        started = time.perf_counter()
        while got < count:
            t0 = time.perf_counter()
            batch = consumer.take(min(n, count - got), timeout=30, commit=False)
            t1 = time.perf_counter()
            consumer.commit(batch)  # what take(commit=True) does before returning
            t2 = time.perf_counter()
            latencies.append(t2 - t0)
            commits.append(t2 - t1)
            got += len(batch)
        seconds = time.perf_counter() - started
        nbytes = int(consumer.metrics.bytes_taken._value.get())
    return _Run(seconds, got, nbytes, tuple(latencies), tuple(commits))


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames], *, groups: int = GROUPS,
        n: int = TAKE_N) -> list[tuple[str, str]]:
    """Rows (figure, value): take() vs raw groups/s and MB/s, their ratio, take latency p50/p99.

    `names_factory(partitions=P)` must return a fresh namespace whose topics exist.
    """
    names = names_factory(partitions=PARTITIONS)
    payloads = make_groups(groups)
    _publish(config, names, payloads)
    runs: dict[str, list[_Run]] = {"raw": [], "decode": [], "take": []}
    for _ in range(REPEATS):  # alternating, so each side sees the same machine noise
        runs["raw"].append(_raw(config, names, groups))
        runs["decode"].append(_raw(config, names, groups, decode_each=True))
        runs["take"].append(_take(config, names, groups, n))
    raw, decoded, take = (min(runs[k], key=lambda r: r.seconds) for k in ("raw", "decode", "take"))
    ms = np.array(take.latencies) * 1000
    commit_ms = np.array(take.commits) * 1000
    mean_kb = sum(map(len, payloads)) / len(payloads) / 1024
    return [
        ("consumer workload", f"{groups} groups of {mean_kb:.0f} KB on {PARTITIONS} partitions, take(n={n}); "
                              f"best of {REPEATS} alternating runs per side"),
        ("take() groups/s", _rate(take)),
        ("raw confluent-kafka groups/s", _rate(raw)),
        ("raw confluent-kafka + rollstream.schemas.decode groups/s", f"{decoded.groups / decoded.seconds:,.0f}"),
        ("ratio take() / raw (target >= 0.8): best of each / median of paired rounds",
         f"{raw.seconds / take.seconds:.2f} / {paired_median(runs['raw'], runs['take']):.2f}"),
        ("ratio (raw + decode) / raw: the ceiling with today's codec", f"{raw.seconds / decoded.seconds:.2f}"),
        ("ratio take() / (raw + decode): the consumer's own cost", f"{decoded.seconds / take.seconds:.2f}"),
        (f"take({n}) latency p50 / p99 ms, commit included",
         f"{np.percentile(ms, 50):.1f} / {np.percentile(ms, 99):.1f}"),
        ("of which commit (manifest + offsets) p50 ms", f"{np.percentile(commit_ms, 50):.1f}"),
    ]


def paired_median(base: list[_Run], ours: list[_Run]) -> float:
    """Median over rounds of base seconds / ours seconds: each pair ran back to back, under the same noise."""
    return float(np.median([b.seconds / o.seconds for b, o in zip(base, ours, strict=True)]))


def _rate(r: _Run) -> str:
    return f"{r.groups / r.seconds:,.0f} ({r.nbytes / r.seconds / 1e6:,.1f} MB/s)"


if __name__ == "__main__":
    from tests.bench._common import run_standalone

    run_standalone(run, "bench-consumer")
