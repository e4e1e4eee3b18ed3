"""The producing side of `bench_pipeline`'s two-process runs, as its own process (as a deployment runs it).

``python -m tests.bench._pipeline_child ours|raw BOOTSTRAP NAMESPACE TRAINER_GROUP GROUP_BYTES COUNT`` makes
the same variants as the parent (seeded), then either runs a `RolloutProducer` until COUNT groups are
published (ours) or produces the very records it would publish with a raw confluent-kafka producer (raw).
It prints the wall-clock time (``time.time()``) of its first prompt or first produce, then exits 0.
"""

from __future__ import annotations

import sys
import time

from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import ProducerSettings, RolloutProducer

from tests.bench._common import start_producer, wait_until
from tests.bench.bench_producer import SAMPLES, encoded_variants, instant_generator, make_variants

VARIANTS = 16
CONCURRENCY = 64
TIMEOUT_S = 120.0


def _ours(config: KafkaConfig, names: TopicNames, group: str, variants: list, count: int) -> float:
    settings = ProducerSettings(namespace=names.namespace, n_samples=SAMPLES, concurrency=CONCURRENCY,
                                max_lag=10**9, trainer_group=group, summary_interval_s=0, watch_control=False)
    producer = RolloutProducer(instant_generator(variants), settings, kafka=config)
    thread, failure = start_producer(producer, "bench-child-producer")
    wait_until(lambda: producer.stats().prompts_taken > 0 or bool(failure), TIMEOUT_S, "the first prompt")
    first = time.time()
    wait_until(lambda: producer.stats().groups_published >= count or bool(failure), TIMEOUT_S, "every group")
    producer.stop()
    thread.join(TIMEOUT_S)
    if failure:
        raise failure[0]
    return first


def _raw(config: KafkaConfig, names: TopicNames, variants: list, count: int) -> float:
    from tests.bench.bench_pipeline import _produce_all, raw_producer

    producer = raw_producer(config, names)
    payloads = encoded_variants(variants)
    first = time.time()
    _produce_all(producer, names.rollouts, count, payloads)
    return first


def main(argv: list[str]) -> None:
    side, bootstrap, namespace, group, group_bytes, count = argv
    config, names = KafkaConfig(bootstrap_servers=bootstrap), TopicNames(namespace)
    variants = make_variants(VARIANTS, int(group_bytes))
    first = (_ours(config, names, group, variants, int(count)) if side == "ours"
             else _raw(config, names, variants, int(count)))
    print(f"{first:.6f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
