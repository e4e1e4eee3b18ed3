"""Producers share the prompts through one consumer group, and a SIGKILLed producer loses nothing.

Pinned: two producers split the prompt partitions and together publish every prompt's group; when one
is killed with SIGKILL mid-run (a real `rollstream produce` process), the other takes its partitions
over and regenerates its unfinished prompts, so NS.rollouts holds every prompt's group: deduplicated by
group_id, exactly the expected set (a duplicate is only ever a regeneration, with the same group_id),
and every prompt offset ends up committed.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings, RolloutProducer

from tests import plugins
from tests.integration._kafka import count, lag, read_all, start_cli, write_prompts


async def until(condition: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition",
                interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval_s)


def settings(namespace: str, producer_id: str, **kw: object) -> ProducerSettings:
    base: dict[str, object] = {"namespace": namespace, "producer_id": producer_id, "n_samples": 2, "concurrency": 2,
                               "max_lag": 10_000, "session_timeout_s": 2.0, "summary_interval_s": 0,
                               "watch_control": False}
    return ProducerSettings(**{**base, **kw})  # type: ignore[arg-type]


def test_two_producers_share_the_prompts(kafka_config: KafkaConfig, namespace_factory,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_TEST_GEN_DELAY_S", "0.15")
    names = namespace_factory(partitions=3)
    # Enough that the partition which moves to the second producer still holds prompts when it moves, whichever
    # the assignor picks (the consumer protocol's may pick the one the first producer is working through).
    ids = [f"s{i:03d}" for i in range(120)]
    write_prompts(kafka_config, names, ids)
    first = RolloutProducer(plugins.slow, settings(names.namespace, "a", exit_when_idle_s=1.5), kafka=kafka_config)
    second = RolloutProducer(plugins.slow, settings(names.namespace, "b", exit_when_idle_s=1.5), kafka=kafka_config)

    async def scenario() -> None:
        run_first = asyncio.create_task(first.run())
        await until(lambda: first.stats().groups_published >= 4, what="the first producer to publish")
        await asyncio.gather(run_first, second.run())

    asyncio.run(scenario())
    groups = read_all(kafka_config, names.rollouts)
    by_producer = {g.producer_id for g in groups}
    assert by_producer == {"a", "b"}, by_producer
    assert {g.prompt_id for g in groups} == set(ids)
    assert len({g.group_id for g in groups}) == len(ids)  # a rebalance may regenerate a group, never lose one
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0


def test_sigkill_of_a_producer_loses_nothing(kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_TEST_GEN_DELAY_S", "0.1")
    names = namespace_factory(partitions=3)
    ids = [f"k{i:02d}" for i in range(80)]  # the survivor's partition still holds prompts when it joins
    write_prompts(kafka_config, names, ids)
    victim = start_cli(bootstrap_servers, "produce", "-N", names.namespace, "--generate", "tests.plugins:slow",
                       "--n-samples", "2", "--concurrency", "4", "--max-lag", "10000", "--producer-id", "victim",
                       "--session-timeout", "2", "--summary-interval", "0", ROLLSTREAM_TEST_GEN_DELAY_S="0.4")
    survivor = RolloutProducer(plugins.slow, settings(names.namespace, "survivor"), kafka=kafka_config)
    intake_group = f"{names.namespace}.producers"
    try:
        async def scenario() -> None:
            await until(lambda: count(kafka_config, names.rollouts) >= 4 or victim.poll() is not None,
                        what="the victim to publish", interval_s=0.2)
            assert victim.poll() is None, victim.communicate()
            run = asyncio.create_task(survivor.run())
            await until(lambda: survivor.stats().groups_published >= 2, what="the survivor to share the work")
            victim.send_signal(signal.SIGKILL)  # mid-run: it has groups in flight
            # After the victim's session times out its partitions move to the survivor, which regenerates
            # what the victim left unacknowledged; done when every prompt offset is committed.
            while await asyncio.to_thread(lag, kafka_config, intake_group, names.prompts):
                assert not run.done(), run.result()
                await asyncio.sleep(0.3)
            survivor.stop()
            await run

        asyncio.run(scenario())
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.communicate(timeout=10)
    assert victim.returncode == -signal.SIGKILL
    groups = read_all(kafka_config, names.rollouts)
    assert {g.group_id for g in groups} == {f"{i}#0" for i in ids}  # every prompt's group, deduplicated
    assert {g.producer_id for g in groups} == {"victim", "survivor"}
    assert all(g.status == "ok" for g in groups)
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0


def test_an_idle_producer_stays_while_prompts_wait_on_partitions_it_does_not_own(
        kafka_config: KafkaConfig, namespace_factory) -> None:
    """The chaos finding of seed 7: a producer that ran out of prompts of its own exited on
    `exit_when_idle_s` while its peer held prompts it never finished; the peer then left too, and
    nobody generated them. An idle producer leaves only when no partition of NS.prompts holds prompts."""
    names = namespace_factory(partitions=2)
    ids = [f"w{i:02d}" for i in range(12)]
    write_prompts(kafka_config, names, ids)

    async def never(prompt: dict[str, object], n: int, sampling_params: dict[str, object]) -> list[dict[str, object]]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    # Its generations never end: a rebalance must not wait for them (drain_on_revoke_s is 30 s by default).
    holder = RolloutProducer(never, settings(names.namespace, "holder", drain_timeout_s=0.2, drain_on_revoke_s=0.5),
                             kafka=kafka_config)
    idler = RolloutProducer(plugins.instant, settings(names.namespace, "idler", exit_when_idle_s=1.0),
                            kafka=kafka_config)

    async def scenario() -> None:
        run_holder = asyncio.create_task(holder.run())
        await until(lambda: holder.stats().in_flight > 0, what="the holder to start prompts")
        run_idler = asyncio.create_task(idler.run())
        await until(lambda: idler.stats().groups_published > 0, what="the idler to publish its partition's groups")
        await asyncio.sleep(4.0)  # four idle periods with prompts waiting on the holder's partition
        assert not run_idler.done(), "the idler exited while the holder's prompts were unfinished"
        holder.stop(force=True)
        await run_holder
        await asyncio.wait_for(run_idler, timeout=60)

    asyncio.run(scenario())
    groups = read_all(kafka_config, names.rollouts)
    assert {g.prompt_id for g in groups} == set(ids)
    assert {g.producer_id for g in groups} == {"idler"}
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0
