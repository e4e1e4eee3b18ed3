"""The fully-async fix's cases, restated for Kafka (see shared/reference/fully-async-fix.md).

1. With instantly completing generations and 60 prompts and no trainer consuming, the trainer's lag
   plateaus at <= 2 x concurrency instead of absorbing the dataset; intake is paused, not stopped.
2. The trainer takes exactly n and commits only those: the surplus stays on the topic, in order, and
   comes first next time (nothing the producer made is dropped); the producer resumes and tops up.
3. The done path never blocks past any cap: with librdkafka's queue capped far below the groups
   finishing at once, every group is published and the event loop keeps running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings, RolloutProducer

from tests import plugins
from tests.integration._kafka import count, lag, read_all, trainer_take, write_prompts

CONCURRENCY = 3


async def until(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def settings(namespace: str, **kw: object) -> ProducerSettings:
    base: dict[str, object] = {"namespace": namespace, "n_samples": 2, "concurrency": CONCURRENCY,
                               "lag_interval_s": 0.2, "summary_interval_s": 0, "watch_control": False}
    return ProducerSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_lag_plateaus_then_resumes_when_the_trainer_commits(kafka_config: KafkaConfig, namespace_factory,
                                                            group_id: str) -> None:
    names = namespace_factory(partitions=3)
    write_prompts(kafka_config, names, [f"p{i:02d}" for i in range(60)])
    producer = RolloutProducer(plugins.instant, settings(names.namespace, trainer_group=group_id), kafka=kafka_config)

    def plateaued() -> bool:
        s = producer.stats()
        return s.paused and s.in_flight == 0

    async def scenario() -> tuple[int, int, int]:
        run = asyncio.create_task(producer.run())
        await until(plateaued, what="intake to pause")
        await asyncio.sleep(1.0)  # five more lag readings: still paused, nothing more published
        first = producer.stats().groups_published
        assert plateaued() and first == await asyncio.to_thread(count, kafka_config, names.rollouts)
        await asyncio.to_thread(trainer_take, kafka_config, names.rollouts, group_id, 4)
        await until(lambda: producer.stats().groups_published > first and plateaued(), what="resume and re-pause")
        await asyncio.sleep(0.6)
        second = producer.stats().groups_published
        producer.stop()
        await run
        return first, second, producer.stats().prompts_taken

    first, second, taken = asyncio.run(scenario())
    assert CONCURRENCY < first <= 2 * CONCURRENCY, first  # plateau: > max_lag, <= max_lag + in-flight
    assert first < second <= 4 + 2 * CONCURRENCY, second  # resumed, and plateaued again
    assert taken <= second + CONCURRENCY  # intake never ran ahead by more than one buffer of prompts
    # Exactly the surplus is kept: the trainer's next take gets every remaining group, nothing was dropped.
    assert lag(kafka_config, group_id, names.rollouts) == second - 4
    rest = trainer_take(kafka_config, names.rollouts, group_id, second - 4)
    everything = read_all(kafka_config, names.rollouts)
    assert len({g.group_id for g in everything}) == second == len(everything)
    assert {g.group_id for g in rest} <= {g.group_id for g in everything}
    # The prompts behind those groups are committed, the rest are not (60 - published remain to take).
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 60 - second


def test_a_full_producer_queue_never_blocks_the_loop(kafka_config: KafkaConfig, namespace_factory,
                                                     group_id: str) -> None:
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"q{i:03d}" for i in range(120)])
    s = settings(names.namespace, concurrency=24, max_lag=10**6, trainer_group=group_id, exit_when_idle_s=0.5,
                 producer_overrides={"queue.buffering.max.messages": 3, "linger.ms": 20})
    stats = RolloutProducer(plugins.instant, s, kafka=kafka_config).run_sync(handle_signals=False)
    assert stats.groups_ok == 120 and stats.groups_failed == 0
    assert stats.queue_full_waits > 0  # the cap was hit, and waited for off the loop
    assert stats.loop_lag_p99_ms < 50, stats
    assert count(kafka_config, names.rollouts) == 120
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0
