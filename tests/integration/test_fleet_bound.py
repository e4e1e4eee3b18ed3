"""One max_lag for the whole fleet: 16 in-process producers share it against a real broker.

Pinned here (docs/operations.md, "Running a producer fleet"; `rollstream.producers._share`): with pushed
backpressure, 16 producers whose generation is instant, each owning one of 16 prompt partitions, and a trainer
that takes 16 groups a step, the trainer group's committed lag, sampled every 50 ms over a window of the run
(between commits), stays within max_lag + every producer's concurrency. Under the old rule each producer would
admit up to the whole max_lag on every commit, and the lag would reach up to 16 x max_lag (seen: 122 and 175
against 48). The shares the producers report sum to max_lag, within a group. It asserts the bound, not a speed
(it only checks that the trainer made steps).
"""

from __future__ import annotations

import asyncio
import threading
import time

from confluent_kafka import TopicPartition
from confluent_kafka.admin import OffsetSpec
from rollstream.consumers import RolloutConsumer, TakeTimeout
from rollstream.infra import KafkaConfig
from rollstream.infra.clients import open_admin
from rollstream.producers import ProducerSettings, RolloutProducer

from tests import plugins
from tests.integration._kafka import write_prompts

PRODUCERS = 16
CONCURRENCY = 2
MAX_LAG = 16
TAKE_N = 16
WINDOW_S = 12.0


class Trainer(threading.Thread):
    """Takes TAKE_N groups a step and commits, until stopped; records the steps and what it committed.

    `commits` is odd while a commit is under way and even otherwise, so a lag sample taken between two
    equal, even readings of it saw no commit: `committed` was the group's committed total throughout."""

    def __init__(self, config: KafkaConfig, namespace: str, group: str) -> None:
        super().__init__(name="fleet-bound-trainer", daemon=True)
        self.config, self.namespace, self.group = config, namespace, group
        self.steps = self.committed = self.commits = 0
        self.taken: list[str] = []  # every group id taken, in order
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with RolloutConsumer(config=self.config, group_id=self.group, namespace=self.namespace,
                                 filters=()) as trainer:  # the instant groups carry no reward
                while not self.stop.is_set():
                    try:
                        batch = trainer.take(TAKE_N, timeout=30, commit=False)
                    except TakeTimeout:
                        if self.stop.is_set():
                            return  # the prompts may have run out by then
                        raise
                    self.stop.wait(0.05)  # a short training step
                    self.commits += 1
                    trainer.commit(batch)
                    self.committed = sum(batch.offsets.values())
                    self.taken += batch.group_ids
                    self.commits += 1
                    self.steps += 1
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc


def sample_lag(config: KafkaConfig, trainer: Trainer, topic: str, stop: threading.Event, out: list[int], *,
               partitions: int = PRODUCERS) -> None:
    """The committed lag every 50 ms: end offsets (read after) minus what the trainer committed (read before
    and after, unchanged: a sample across a commit is dropped, since it could count the groups that the
    commit made room for against the offsets before it)."""
    admin = open_admin(config.admin())
    query = {TopicPartition(topic, p): OffsetSpec.latest() for p in range(partitions)}
    while not stop.wait(0.05):
        before, committed = trainer.commits, trainer.committed
        ends = sum(f.result(timeout=10.0).offset for f in admin.list_offsets(query, request_timeout=5.0).values())
        if before % 2 == 0 and trainer.commits == before:
            out.append(ends - committed)


def test_sixteen_producers_share_one_max_lag(kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    names = namespace_factory(partitions=PRODUCERS)
    write_prompts(kafka_config, names, [f"f{i:04d}" for i in range(4000)])
    producers = [RolloutProducer(plugins.instant, ProducerSettings(
        namespace=names.namespace, producer_id=f"fleet-{i:02d}", n_samples=2, concurrency=CONCURRENCY,
        max_lag=MAX_LAG, trainer_group=group_id, summary_interval_s=0, session_timeout_s=6.0, lag_interval_s=0.5),
        kafka=kafka_config) for i in range(PRODUCERS)]
    trainer = Trainer(kafka_config, names.namespace, group_id)
    lags: list[int] = []
    stop_sampling = threading.Event()

    def all_assigned() -> bool:
        return all(p._parts is not None and p._parts.intake.owned() for p in producers)  # noqa: SLF001

    async def scenario() -> list[float]:
        runs = [asyncio.create_task(p.run()) for p in producers]
        trainer.start()
        deadline = time.monotonic() + 60
        while not all_assigned():
            assert time.monotonic() < deadline, "16 producers did not all get a prompt partition in 60 s"
            assert not any(r.done() for r in runs), [r.exception() for r in runs if r.done()]
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # every member assigned; let shares and positions settle
        sampler = threading.Thread(target=sample_lag, args=(kafka_config, trainer, names.rollouts, stop_sampling, lags),
                                   name="fleet-bound-lag", daemon=True)
        sampler.start()
        await asyncio.sleep(WINDOW_S)
        stop_sampling.set()
        shares = [p.registry.get_sample_value("rollstream_producer_lag_share_records") or 0.0 for p in producers]
        trainer.stop.set()  # first, while the producers still serve its last take
        await asyncio.to_thread(trainer.join, 70)
        for p in producers:
            p.stop()
        await asyncio.gather(*runs)
        await asyncio.to_thread(sampler.join, 15)
        return shares

    shares = asyncio.run(scenario())
    assert trainer.error is None, trainer.error
    assert trainer.steps >= 5, f"the trainer made {trainer.steps} steps: the window measured nothing"
    assert len(lags) >= 20, lags
    bound = MAX_LAG + PRODUCERS * CONCURRENCY
    assert max(lags) <= bound, f"lag reached {max(lags)} > max_lag {MAX_LAG} + in flight: {sorted(lags)[-10:]}"
    # The partition parts sum to max_lag; the consumption parts may drift from it by a fraction of a group
    # while producers that joined at different steps converge (`rollstream.producers._share`).
    assert sum(shares) < MAX_LAG + 1, (sum(shares), shares)
