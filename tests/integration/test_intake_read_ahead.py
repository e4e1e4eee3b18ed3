"""Intake's librdkafka client reads only a little of NS.prompts ahead (`rollstream.producers.intake._read_ahead`).

With the consumer defaults sized for 64 MiB rollouts it fetched 4 MiB of compressed prompt batches per partition
whenever fewer than a thousand prompts were queued: a whole 120,000-prompt topic sat in librdkafka at once
(`make soak`: ~200 MiB of malloc held and drained for minutes, docs/benchmarks.md#trainer-memory).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers.gate import LagGate
from rollstream.producers.intake import Intake
from rollstream.producers.metrics import ProducerMetrics
from rollstream.producers.prompts import load_prompts

PROMPTS = 120_000
READ_AHEAD_BOUND = 40_000  # one fetch of a few record batches per partition (~3,300 of these prompts each)


def _intake_conf(kafka: KafkaConfig, names: TopicNames, overrides: dict[str, object] | None = None) -> dict:
    metrics = ProducerMetrics()
    gate = LagGate(kafka, "trainer", names.rollouts, max_lag=1, interval_s=1.0, metrics=metrics)
    intake = Intake(kafka, names.prompts, f"{names.namespace}.producers", gate=gate, metrics=metrics, prefetch=2,
                    overrides=overrides)
    return dict(intake._client._conf)


def _read_ahead(conf: dict, topic: str, partitions: int, seconds: float) -> int:
    """The most prompts librdkafka fetched ahead of a consumer of `conf` that takes none for `seconds`.

    librdkafka fetches in its own threads whether or not the application polls; its statistics come through the
    same queue as the records, so they are read afterwards, each as of when it was made."""
    queued: list[int] = [0]

    def stats(raw: str) -> None:
        parts = json.loads(raw)["topics"].get(topic, {}).get("partitions", {})
        # Each partition's queue is forwarded to the consumer's one, whose count each of them reports.
        queued.append(max((p["fetchq_cnt"] for key, p in parts.items() if int(key) >= 0), default=0))

    consumer = Consumer({**conf, "statistics.interval.ms": 100, "stats_cb": stats})
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        time.sleep(seconds)
        reports = int(seconds / 0.1) // 2
        deadline = time.monotonic() + 30
        while len(queued) <= reports and time.monotonic() < deadline:
            consumer.consume(num_messages=10_000, timeout=0.1)
    finally:
        consumer.close()
    return max(queued)


def test_intake_reads_a_bounded_number_of_prompts_ahead(kafka_config: KafkaConfig, namespace: TopicNames,
                                                         tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(PROMPTS)))
    assert load_prompts(path, kafka_config, namespace=namespace.namespace) == PROMPTS

    queued = _read_ahead(_intake_conf(kafka_config, namespace), namespace.prompts, 3, seconds=3.0)
    assert 0 < queued < READ_AHEAD_BOUND, f"librdkafka held {queued} of {PROMPTS} prompts ahead of intake"

    # The consumer defaults (what intake had before), for contrast: every prompt of the topic, fetched at once.
    everything = {"max.partition.fetch.bytes": 4 << 20, "fetch.max.bytes": 16 << 20, "message.max.bytes": 16 << 20,
                  "queued.max.messages.kbytes": 64 << 10}
    assert _read_ahead(_intake_conf(kafka_config, namespace, everything), namespace.prompts, 3, seconds=3.0) >= PROMPTS
