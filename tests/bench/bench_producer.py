"""Producer-side throughput and loop health, side by side in one run.

1. `RolloutProducer` with an instant generate function making ~100 KB groups (8 samples of random
   tokens + logprobs, 64 distinct variants): prompt intake, group building, Avro encoding, publishing and
   committing, vs a raw confluent-kafka producer sending the same encoded records (same bytes, same client
   config: idempotent, acks=all, lz4) to a topic with the same partitions, all queued at once. Each side runs `REPEATS`
   times, alternating; its best run counts (the machine is shared and noisy). Target ratio >= 0.8.
2. Event-loop lag while intake is paused under backpressure (no trainer consuming; lag gate closed;
   intake and lag threads still polling): p99 of how late a 10 ms timer fires. Target < 10 ms.

Run alone: ``python -m tests.bench.bench_producer`` (uses ``ROLLSTREAM_BOOTSTRAP_SERVERS``; prints a
markdown table). ``make bench`` calls `run`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from confluent_kafka import Producer
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import Generation, ProducerSettings, RolloutProducer
from rollstream.producers._groups import Outcome, record_of
from rollstream.producers.engines.custom import completion_from_dict
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import LoopLagProbe
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, encode, now_ms

from tests.bench._common import delete_topics, topic_factory

GROUP_BYTES = 100 * 1024
SAMPLES = 8
PARTITIONS = 3
REPEATS = 5
VARIANTS = 64


@dataclass(frozen=True)
class _Run:
    seconds: float
    groups: int
    nbytes: int
    loop_lag_p99_ms: float = 0.0
    cpu_wait_share: float | None = None  # of the loop thread's wall time: runnable, waiting for a CPU


def _schedstat() -> tuple[int, int] | None:
    """The calling thread's (ns on a CPU, ns runnable but waiting for one) from Linux's schedstat; None
    where the kernel does not keep it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu), int(waiting)


def make_variants(count: int = VARIANTS, group_bytes: int = GROUP_BYTES) -> list[list[dict[str, Any]]]:
    """`count` distinct sets of `SAMPLES` completions of ~`group_bytes` in all (random tokens and logprobs,
    like real ones: lz4 gets what it would get on real data, and identical records cannot flatter either side)."""
    rng = np.random.default_rng(0)
    tokens = max(1, (group_bytes - 1024) // (SAMPLES * 8))  # 4 bytes token + 4 bytes logprob
    return [[{"text": "x" * 32, "tokens": rng.integers(0, 150_000, tokens, dtype=np.int32),
              "logprobs": -rng.random(tokens, dtype=np.float32), "finish_reason": "length"}
             for _ in range(SAMPLES)] for _ in range(count)]


def instant_generator(variants: list[list[dict[str, Any]]]) -> Callable[..., Any]:
    """An instant generate function: prompt ``b<i>`` gets variant ``i % len(variants)``."""
    async def generate(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        return variants[int(prompt["id"][1:]) % len(variants)][:n]

    return generate


def encoded_variants(variants: list[list[dict[str, Any]]]) -> list[bytes]:
    """The records the producer publishes for those variants, byte for byte the same size and content."""
    out = []
    for i, completions in enumerate(variants):
        prompt = Prompt(id=f"b{i}", prompt=f"q{i}")
        generation = Generation(completions=[completion_from_dict(c, "bench", j) for j, c in enumerate(completions)],
                                prompt_text=f"q{i}")
        taken = TakenPrompt(0, i, 1, prompt, None, now_ms(), encode(prompt))  # the prompt record rides along
        outcome = Outcome(generation=generation, rewards=[None] * len(completions), versions=[0] * len(completions))
        out.append(encode(record_of(taken, outcome, "full", producer_id="bench", prompts_topic="bench.prompts",
                                    max_attempts=ProducerSettings().max_attempts)))
    return out


def _prompts(config: KafkaConfig, names: TopicNames, count: int) -> None:
    publish_prompts([Prompt(id=f"b{i}", prompt=f"q{i}") for i in range(count)], config, names.prompts)


def _rollstream(config: KafkaConfig, names: TopicNames, groups: int, concurrency: int,
                variants: list[list[dict[str, Any]]]) -> _Run:
    _prompts(config, names, groups)
    settings = ProducerSettings(namespace=names.namespace, n_samples=SAMPLES, concurrency=concurrency,
                                max_lag=10**9, summary_interval_s=0, watch_control=False)
    producer = RolloutProducer(instant_generator(variants), settings, kafka=config)
    probe = LoopLagProbe(interval_s=0.01)

    async def scenario() -> tuple[float, float, float | None]:
        run = asyncio.create_task(producer.run())
        probe_task = asyncio.create_task(probe.run())
        while producer.stats().prompts_taken == 0:  # the clock starts with the first prompt, as for raw
            await asyncio.sleep(0.001)
        started, sched_at_start = time.perf_counter(), _schedstat()
        while producer.stats().groups_published < groups:
            await asyncio.sleep(0.002)
        seconds, sched_at_end = time.perf_counter() - started, _schedstat()
        probe_task.cancel()
        producer.stop()
        await run
        waiting = (None if sched_at_start is None or sched_at_end is None
                   else (sched_at_end[1] - sched_at_start[1]) / 1e9 / seconds)
        return seconds, probe.percentile_ms(0.99), waiting

    seconds, lag_p99, waiting = asyncio.run(scenario())
    return _Run(seconds, groups, producer.stats().bytes_published, lag_p99, waiting)


def _raw(config: KafkaConfig, names: TopicNames, groups: int, payloads: list[bytes]) -> _Run:
    producer = Producer(config.producer())
    # Warm up as the RolloutProducer is by the time its clock starts: connected, producer id acquired,
    # the topic's metadata known.
    producer.list_topics(names.rollouts, timeout=10)
    producer.produce(names.prompts, b"warm-up")
    producer.flush(10)
    nbytes = 0
    started = time.perf_counter()
    for i in range(groups):
        payload = payloads[i % len(payloads)]
        nbytes += len(payload)
        while True:
            try:
                producer.produce(names.rollouts, payload, key=f"b{i}#0".encode())
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("bench: raw producer did not finish in 120 s")
    return _Run(time.perf_counter() - started, groups, nbytes)


def _paused_loop_lag(config: KafkaConfig, names: TopicNames, seconds: float,
                     variants: list[list[dict[str, Any]]]) -> tuple[float, float, int]:
    """Loop-lag p99/max while paused by backpressure: max_lag 8, no trainer, plenty of prompts waiting."""
    _prompts(config, names, 200)
    settings = ProducerSettings(namespace=names.namespace, n_samples=SAMPLES, concurrency=16, max_lag=8,
                                lag_interval_s=0.2, summary_interval_s=0, watch_control=False)
    producer = RolloutProducer(instant_generator(variants), settings, kafka=config)
    probe = LoopLagProbe(interval_s=0.01)

    async def scenario() -> tuple[float, float, int]:
        run = asyncio.create_task(producer.run())
        while not (producer.stats().paused and producer.stats().in_flight == 0):
            await asyncio.sleep(0.01)
        probe_task = asyncio.create_task(probe.run())
        await asyncio.sleep(seconds)
        probe_task.cancel()
        published = producer.stats().groups_published
        producer.stop()
        await run
        return probe.percentile_ms(0.99), probe.max_ms(), published

    return asyncio.run(scenario())


def run(config: KafkaConfig, names_factory: Callable[..., TopicNames] | None = None, *, groups: int = 1000,
        concurrency: int = 64, paused_s: float = 3.0) -> list[tuple[str, str]]:
    """Rows (figure, value): producer vs raw groups/s and MB/s, their ratio, loop lag while paused.

    `names_factory(partitions=P)` returns a fresh namespace whose topics exist (default: made here and
    deleted afterwards).
    """
    made: list[TopicNames] = []
    factory = names_factory or topic_factory(config, made, "bench-producer")
    variants = make_variants()
    payloads = encoded_variants(variants)
    try:
        ours, raws = [], []
        for _ in range(REPEATS):
            ours.append(_rollstream(config, factory(partitions=PARTITIONS), groups, concurrency, variants))
            raws.append(_raw(config, factory(partitions=PARTITIONS), groups, payloads))
        paused_p99, paused_max, held = _paused_loop_lag(config, factory(partitions=PARTITIONS), paused_s, variants)
    finally:
        delete_topics(config, made)
    best = min(ours, key=lambda r: r.seconds)
    raw = min(raws, key=lambda r: r.seconds)
    return [
        ("producer workload", f"{groups} groups of {best.nbytes / best.groups / 1024:.0f} KB, instant generate, "
                              f"concurrency {concurrency}, {PARTITIONS} partitions"),
        ("RolloutProducer groups/s", f"{best.groups / best.seconds:,.0f}"),
        ("RolloutProducer MB/s", f"{best.nbytes / best.seconds / 1e6:,.1f}"),
        ("raw confluent-kafka groups/s", f"{raw.groups / raw.seconds:,.0f}"),
        ("raw confluent-kafka MB/s", f"{raw.nbytes / raw.seconds / 1e6:,.1f}"),
        ("ratio producer / raw (target >= 0.8)", f"{raw.seconds / best.seconds:.2f}"),
        ("event-loop lag p99 ms while publishing flat out", f"{best.loop_lag_p99_ms:.1f}"),
        ("loop thread runnable but waiting for a CPU while publishing flat out (share of the run)",
         "unknown (no /proc schedstat)" if best.cpu_wait_share is None else f"{best.cpu_wait_share:.0%}"),
        ("event-loop lag p99 ms while paused by backpressure (target < 10)", f"{paused_p99:.2f}"),
        ("event-loop lag max ms while paused by backpressure", f"{paused_max:.2f} ({held} groups held at max_lag 8)"),
    ]


if __name__ == "__main__":
    from tests.bench._common import run_standalone

    run_standalone(run, "bench-producer")
