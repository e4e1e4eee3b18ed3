"""Intake's consumer group on NS.prompts: a rebalance wastes no generation, and each producer's state is readable.

Pinned:
1. Scaling producers 1 -> 3 -> 1 in a clean run (nothing killed) generates every prompt exactly once: on a
   revocation the owner stops starting prompts of the revoked partitions, lets the started ones finish
   and commits them before the partitions move (a bounded drain), so the next owner regenerates nothing.
   The trainer (`RolloutConsumer`, audit) takes every prompt once and records 0 duplicates; NS.rollouts
   holds no group twice. (A SIGKILLed producer still loses nothing: test_producer_sharing pins that.)
   Each producer's metrics follow its prompt partitions: `assigned_partitions` is what it owns, and
   `rebalances_total` counts the changes (a's assignment, its revocation when b and c join, its partitions back).
2. A producer's state rides on its prompt-offset commits (`rollstream.infra.producer_state.ProducerState` in the commit
   metadata): a producer held by backpressure is seen paused in the group's committed offsets within about a
   second, and seen running again once the trainer's lag falls.

The producers use static membership (``producer_id``, as `rollstream produce --producer-id` and the demo
do): a stopped static member does not leave the group, so its partitions move to the survivor only after
the session timeout (2 s here); that costs seconds, but it is the path production takes, and it lets
the records say which producer generated what.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions
from confluent_kafka.admin import AdminClient
from rollstream.consumers import Batch, RolloutConsumer, TakeTimeout, audit
from rollstream.infra import KafkaConfig, LagReader, TopicNames
from rollstream.infra.clients import open_producer
from rollstream.infra.group_protocol import broker_protocols
from rollstream.infra.kafka_io import produce_and_wait
from rollstream.infra.producer_state import ProducerState
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.schemas import Prompt, encode

from tests.integration._kafka import group_protocol, lag, read_all, trainer_take, write_prompts

N = 360  # room for every phase: the first producer works through a good part alone before others join
PARTITIONS = 6
GEN_DELAY_S = 0.1  # per group: with concurrency 6 a producer always has prompts in flight when a partition moves
SESSION_S = 2.0


async def generate(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    await asyncio.sleep(GEN_DELAY_S)
    return [{"text": "the answer is 42", "tokens": [1, 2, 3, i], "logprobs": [-0.5] * 4, "finish_reason": "stop"}
            for i in range(n)]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def producer(kafka_config: KafkaConfig, names: TopicNames, producer_id: str, **kw: Any) -> RolloutProducer:
    base: dict[str, Any] = {"namespace": names.namespace, "producer_id": producer_id, "n_samples": 2,
                            "concurrency": 6, "max_lag": 100_000, "session_timeout_s": SESSION_S,
                            "summary_interval_s": 0, "watch_control": False, "group_protocol": group_protocol(),
                            # Small fetches (of small batches) interleave the partitions, so every partition has
                            # prompts in flight when it moves (with intake's 64 KiB per partition, a few hundred
                            # of these prompts, a producer works through one partition's backlog at a time, and a
                            # rebalance would move only untouched ones).
                            "intake_overrides": {"max.partition.fetch.bytes": 1024}}
    return RolloutProducer(generate, ProducerSettings(**{**base, **kw}), kafka=kafka_config)


def write_in_small_batches(config: KafkaConfig, names: TopicNames, ids: list[str]) -> None:
    """Prompts as `write_prompts` writes them, in record batches of a few each: with the intake's small
    fetches (see `producer`), a partition's backlog then takes many fetches, interleaved with the others."""
    records = [(i.encode(), encode(Prompt(id=i, prompt=f"question {i}", label="42"))) for i in ids]
    assert produce_and_wait(open_producer(config.producer({"linger.ms": 0, "batch.size": 256})), names.prompts,
                            records, timeout=30) == len(ids)


def drained_groups(caplog: pytest.LogCaptureFixture) -> int:
    """In-flight groups that revocation drains let finish (from intake's log lines)."""
    found = [re.search(r"(\d+) in-flight groups? finished", r.getMessage()) for r in caplog.records
             if r.name == "rollstream.producers.intake"]
    return sum(int(m.group(1)) for m in found if m)


def committed_everywhere(config: KafkaConfig, names: TopicNames) -> bool:
    """Whether the producers' group committed some prompts on every prompt partition."""
    with LagReader(config) as reader:
        partitions = reader.group_lag(f"{names.namespace}.producers", names.prompts).partitions
    return all(p.committed is not None and p.committed > p.start for p in partitions)


def owned(p: RolloutProducer) -> int:
    """The prompt partitions `p` owns, as its ``assigned_partitions`` gauge says."""
    value = p.registry.get_sample_value("rollstream_producer_assigned_partitions")
    assert value is not None
    return int(value)


def changes(p: RolloutProducer, change: str) -> int:
    """How often `p`'s prompt partitions were `change` (assigned, revoked, lost), as its metrics count."""
    value = p.registry.get_sample_value("rollstream_producer_rebalances_total", {"change": change})
    assert value is not None
    return int(value)


def take_everything(bootstrap: str, names: TopicNames, group: str) -> list[Batch]:
    with RolloutConsumer(bootstrap, group_id=group, namespace=names.namespace, filters=()) as trainer:
        batches = [trainer.take(60, timeout=30) for _ in range(N // 60)]
        with pytest.raises(TakeTimeout):
            trainer.take(1, timeout=1.5)  # nothing left: not even a duplicate
        assert trainer.lag().total == 0
    return batches


@pytest.mark.parametrize("protocol", ["classic", "consumer"])
def test_scaling_producers_1_3_1_generates_every_prompt_once(kafka_config: KafkaConfig, bootstrap_servers: str,
                                                             namespace_factory: Any, group_id: str,
                                                             caplog: pytest.LogCaptureFixture, protocol: str) -> None:
    if protocol == "consumer" and "consumer" not in (broker_protocols(kafka_config, 5.0) or ()):
        pytest.skip("this broker does not serve the consumer group protocol (KIP-848: Kafka >= 4.0)")
    caplog.set_level(logging.INFO, logger="rollstream.producers.intake")
    names = namespace_factory(partitions=PARTITIONS)
    ids = [f"r{i:03d}" for i in range(N)]
    write_in_small_batches(kafka_config, names, ids)
    a, b, c = (producer(kafka_config, names, pid, group_protocol=protocol) for pid in ("a", "b", "c"))
    published: dict[str, int] = {}
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    async def scenario() -> None:
        run_a = asyncio.create_task(a.run())
        await until(lambda: a.stats().groups_published >= 30, "a to publish alone")
        # Until a works on every partition: then whichever partitions move have groups in flight (a consumer's
        # fetch order may leave some partitions untouched for a while, the consumer protocol's more often).
        while not await asyncio.to_thread(committed_everywhere, kafka_config, names):
            assert not run_a.done(), run_a.result()
            await asyncio.sleep(0.1)
        timings["1 producer"] = time.monotonic() - t0
        assert owned(a) == PARTITIONS and changes(a, "assigned") >= 1 and changes(a, "revoked") == 0
        runs = [asyncio.create_task(p.run()) for p in (b, c)]  # scale up: a's partitions move while in flight
        await until(lambda: min(b.stats().groups_published, c.stats().groups_published) >= 20, "b and c to publish")
        timings["3 producers"] = time.monotonic() - t0
        await until(lambda: owned(a) + owned(b) + owned(c) == PARTITIONS and min(map(owned, (a, b, c))) > 0,
                    "every producer to own some of the partitions, each owned once")
        assert changes(a, "revoked") >= 1 and changes(b, "assigned") >= 1 and changes(c, "assigned") >= 1
        assert owned(a) == len(a._parts.intake.owned())  # type: ignore[union-attr]  # noqa: SLF001
        assigned_before = changes(a, "assigned")
        b.stop()  # scale down, gracefully: b and c finish what they started and commit it
        c.stop()
        await asyncio.gather(*runs)
        published["a at scale-down"] = a.stats().groups_published
        timings["b, c stopped"] = time.monotonic() - t0
        while await asyncio.to_thread(lag, kafka_config, f"{names.namespace}.producers", names.prompts):
            assert not run_a.done(), run_a.result()
            await asyncio.sleep(0.2)
        timings["all committed"] = time.monotonic() - t0
        assert owned(a) == PARTITIONS and changes(a, "assigned") > assigned_before
        a.stop()
        await run_a

    asyncio.run(scenario())
    groups = read_all(kafka_config, names.rollouts)
    repeats = {gid: k for gid, k in Counter(g.group_id for g in groups).items() if k > 1}
    by_producer = Counter(g.producer_id for g in groups)
    print(f"\n1->3->1: {len(groups)} records for {N} prompts, {len(repeats)} generated twice {sorted(repeats)[:8]}; "
          f"by producer {dict(by_producer)}; drains let {drained_groups(caplog)} in-flight groups finish; "
          + ", ".join(f"{k} at {v:.1f} s" for k, v in timings.items()))
    assert set(by_producer) == {"a", "b", "c"}
    assert a.stats().groups_published > published["a at scale-down"]  # a took b's and c's partitions back
    if protocol == "classic":  # cooperative-sticky moves partitions the producer has groups in flight on
        assert drained_groups(caplog) > 0  # partitions did move while groups were in flight
    # Under the consumer protocol the broker's assignor often moves only partitions whose prompts a had no
    # group in flight for at that moment (seen in about half the runs): no drain to see then, and nothing to
    # regenerate either; the assertions below hold all the same.
    assert not repeats, f"{len(repeats)} prompts generated twice: {sorted(repeats)}"
    assert sorted(g.prompt_id for g in groups) == ids and all(g.status == "ok" for g in groups)

    batches = take_everything(bootstrap_servers, names, group_id)
    taken = Counter(g.prompt_id for b in batches for g in b.groups)
    assert sorted(taken) == ids and set(taken.values()) == {1}  # every prompt exactly once, nothing lost
    assert sum(b.counts()["duplicate"] for b in batches) == 0
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["taken"] == N and report.counts["duplicate"] == 0, report.summary()


# -- the producer's state in its commits ---------------------------------------------------------------


def committed_states(admin: AdminClient, group: str) -> list[ProducerState]:
    """The producer states in `group`'s committed offsets (one per partition that carries one)."""
    future = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)], request_timeout=5)[group]
    found = [ProducerState.from_metadata(tp.metadata) for tp in future.result().topic_partitions]
    return [state for state in found if state is not None]


def test_a_paused_producers_state_is_readable_from_the_committed_offsets(kafka_config: KafkaConfig,
                                                                         namespace_factory: Any, group_id: str) -> None:
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"s{i:02d}" for i in range(4)])
    # max_lag 1: two groups published and nobody training close the gate; polling reads the lag every 0.2 s.
    paused_producer = producer(kafka_config, names, "state-1", concurrency=2, max_lag=1, trainer_group=group_id,
                               backpressure="poll", lag_interval_s=0.2)
    admin = AdminClient(kafka_config.admin())
    intake_group = f"{names.namespace}.producers"
    seen: dict[str, ProducerState] = {}

    async def state_is(paused: bool, what: str) -> float:
        started = time.monotonic()

        def check() -> bool:
            states = committed_states(admin, intake_group)
            if states and all(s.paused is paused for s in states):
                seen[what] = max(states, key=lambda s: s.updated_at_ms)
                return True
            return False

        await until(check, f"the committed state to say {what}", timeout_s=15.0)
        return time.monotonic() - started

    async def scenario() -> None:
        run = asyncio.create_task(paused_producer.run())
        await until(lambda: paused_producer.stats().paused, "backpressure to pause the producer")
        paused_after = await state_is(True, "paused")
        assert paused_after < 2.5, f"the paused state took {paused_after:.1f} s to reach the commits"
        # The trainer takes the first two: the gate opens (for a moment: two more close it again), then
        # the last two: it stays open, with no prompt left.
        await asyncio.to_thread(trainer_take, kafka_config, names.rollouts, group_id, 2)
        await until(lambda: paused_producer.stats().groups_published == 4, "the last two groups")
        await asyncio.to_thread(trainer_take, kafka_config, names.rollouts, group_id, 2)
        await state_is(False, "running")
        paused_producer.stop()
        await run

    asyncio.run(scenario())
    paused, running = seen["paused"], seen["running"]
    assert paused.producer_id == running.producer_id == "state-1"
    assert paused.max_lag == running.max_lag == 1
    assert paused.since_ms <= paused.updated_at_ms and paused.since_ms < running.since_ms <= running.updated_at_ms
