"""`rollstream status` and `TakeTimeout` say why a trainer waits, against a real broker.

Pinned here: (1) the three causes of the issue, each named by both the CLI and the timed-out take: no
producer, prompts exhausted, everything filtered (plus every producer paused, from the producers' commit
metadata); (2) the CLI's exit status (1 blocked, 0 idle); (3) TakeTimeout stays cheap in a ``timeout=0``
retry loop (the cluster is read once and reused); (4) against an unreachable cluster `status` and the
diagnosis return in bounded time and report what they could not read instead of raising.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter

import pytest
from confluent_kafka import Consumer
from rollstream.consumers import RolloutConsumer, TakeTimeout, status
from rollstream.consumers.forensics._diagnose import TimeoutDiagnoser
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.kafka_io import commit_offsets
from rollstream.infra.producer_state import ProducerState
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, now_ms

from tests.conftest import free_port
from tests.integration._kafka import end_offsets, start_cli, until, write_prompts
from tests.records import make_group, publish


def _timed_out(c: RolloutConsumer) -> TakeTimeout:
    """take(2, timeout=3)'s TakeTimeout, once its diagnosis has the cluster part: a take waits at most a quarter
    of its timeout for that read, so on a slow machine the first one may only say it is being read."""
    for _ in range(2):
        with pytest.raises(TakeTimeout) as info:
            c.take(2, timeout=3)
        if info.value.diagnosis.read_at_ms is not None:
            break
    return info.value


def _take_timeout(kafka_config: KafkaConfig, names: TopicNames, group_id: str, **kw: object) -> TakeTimeout:
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, **kw) as c:  # type: ignore[arg-type]
        return _timed_out(c)


def _status_cli(bootstrap: str, names: TopicNames, group_id: str, *args: str):
    return start_cli(bootstrap, "status", "--namespace", names.namespace, "--group", group_id, *args)


def test_no_producer(kafka_config, namespace_factory, group_id, bootstrap_servers) -> None:
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, ["a", "b", "c", "d"])
    cli = _status_cli(bootstrap_servers, names, group_id, "--json")
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        exc = _timed_out(c)
        assert (exc.wanted, exc.gathered, exc.timeout) == (2, 0, 3)
        assert f"0 producers in {names.producer_group}: start one with 'rollstream produce" in str(exc)
        assert "looked at no group" in str(exc) and "(4 prompts left)" in str(exc)
        assert exc.diagnosis.causes[0].code == "no_producer" and exc.diagnosis.blocked
        started, first = time.monotonic(), exc.diagnosis.read_at_ms
        for _ in range(20):  # a timeout=0 retry loop: the cluster is not read again
            with pytest.raises(TakeTimeout) as again:
                c.take(2, timeout=0)
            assert again.value.diagnosis.read_at_ms == first
        assert time.monotonic() - started < 1.0
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 1, err  # blocked: prompts are left and nobody generates them
    report = json.loads(out)
    assert report["producers"]["members"] == [] and report["prompts"]["left"] == 4
    assert report["prompts"]["epochs"] == [{"epoch": 0, "left": 4, "requeued": 0}]
    assert report["trainer"]["lag"] == 0 and report["trainer"]["last_step"] is None
    assert report["diagnosis"]["causes"][0]["code"] == "no_producer" and report["unavailable"] == {}


def _stand_in_producer(kafka_config: KafkaConfig, names: TopicNames, producer_id: str) -> Consumer:
    """A member of the producers' group, as `rollstream.producers.intake` joins it (static membership)."""
    consumer = Consumer(kafka_config.consumer(names.producer_group, {
        "group.instance.id": producer_id, "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10000}))
    consumer.subscribe([names.prompts])
    until(lambda: (consumer.poll(0.1), consumer.assignment())[1], 20, "the stand-in producer's assignment")
    return consumer


def _commit_state(consumer: Consumer, names: TopicNames, offsets: dict[int, int], producer_id: str,
                  paused: bool) -> ProducerState:
    state = ProducerState(producer_id, paused=paused, since_ms=now_ms() - 5000, max_lag=8, updated_at_ms=now_ms())
    commit_offsets(consumer, names.prompts, offsets, metadata=state.to_metadata())
    return state


def test_prompts_exhausted_and_producers_paused(kafka_config, namespace_factory, group_id,
                                                bootstrap_servers) -> None:
    names = namespace_factory(partitions=2)
    publish_prompts([Prompt(id=i, prompt=f"q {i}") for i in "abcd"], kafka_config, names.prompts, epochs=3)
    producer = _stand_in_producer(kafka_config, names, "gpu-0")
    try:
        _commit_state(producer, names, {0: 0, 1: 0}, "gpu-0", paused=True)
        paused = status(kafka_config, names.namespace, trainer_group=group_id, timeout=5)
        [member] = paused.producers.members
        assert (member.producer_id, member.partitions, member.paused) == ("gpu-0", (0, 1), True)
        assert paused.diagnosis.causes[0].code == "producers_paused"
        assert f"all 1 producers in {names.producer_group} paused by backpressure" in paused.diagnosis.why()
        ends = end_offsets(kafka_config, names.prompts)
        _commit_state(producer, names, ends, "gpu-0", paused=False)  # it generated every prompt
        cli = _status_cli(bootstrap_servers, names, group_id)
        exc = _take_timeout(kafka_config, names, group_id)
        exhausted = (f"0 prompts left in epoch 2 ({names.prompts} fully consumed by {names.producer_group}): "
                     f"load more with 'rollstream prompts load FILE.jsonl --namespace {names.namespace} "
                     "--start-epoch 3'")
        assert exhausted in str(exc) and exc.diagnosis.causes[0].code == "prompts_exhausted"
        assert not exc.diagnosis.blocked  # idle: no work left
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        assert f"producers: 1 alive in {names.producer_group} (group STABLE), 0 paused" in out
        assert "gpu-0: open for " in out and "partitions 0,1 member gpu-0-" in out
        assert "prompts: 0 left of 12 stored" in out and exhausted in out and "diagnosis: idle" in out
    finally:
        producer.close()


def test_a_real_producer_paused_by_backpressure(kafka_config, namespace_factory, group_id, bootstrap_servers) -> None:
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"q{i}" for i in range(20)])
    producer = start_cli(bootstrap_servers, "produce", "--namespace", names.namespace, "--generate",
                         "tests.plugins:instant", "--reward", "tests.plugins:reward", "--n-samples", "2",
                         "--max-lag", "2", "--producer-id", "gpu-7", "--trainer-group", group_id)
    try:
        def paused():
            report = status(kafka_config, names.namespace, trainer_group=group_id, timeout=5)
            return report if report.producers is not None and report.producers.paused else None

        report = until(paused, 30, "the producer's paused state in its commit metadata", interval_s=0.5)
    finally:
        producer.terminate()
        producer.communicate(timeout=30)
    [member] = report.producers.members
    assert (member.producer_id, member.partitions, member.state.max_lag) == ("gpu-7", (0, 1), 2)
    assert report.trainer.lag >= 2 and 0 < report.prompts.left < 20
    [cause] = [c for c in report.diagnosis.causes if c.code == "producers_paused"]
    assert cause.blocking and f"all 1 producers in {names.producer_group} paused by backpressure" in cause.message


def test_everything_filtered(kafka_config, namespace_factory, group_id, bootstrap_servers) -> None:
    names = namespace_factory(partitions=1)
    publish(kafka_config, names, [make_group(f"s{i}", versions=(1,)) for i in range(3)]
            + [make_group(f"e{i}", rewards=(1.0, 1.0), versions=(5,)) for i in range(3)])
    cli = _status_cli(bootstrap_servers, names, group_id, "--max-staleness", "0", "--policy-version", "5")
    exc = _take_timeout(kafka_config, names, group_id, max_staleness=0, policy_version=5)
    assert "This take looked at 6 groups: " in str(exc)
    assert exc.diagnosis.causes[0].code == "all_skipped" and exc.diagnosis.blocked
    assert ("the last 6 groups looked at were all filtered: all_rewards_equal 3, stale 3 (max_staleness=0, "
            "policy version 5)") in str(exc)
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 1, err
    assert "next 6 groups past its committed offsets: 0 acceptable, skipped all_rewards_equal 3, stale 3" in out
    assert (f"! the next 6 groups waiting for {group_id} (past its committed offsets) would all be filtered: "
            "all_rewards_equal 3, stale 3 (max_staleness=0, policy version 5)") in out
    assert "diagnosis: BLOCKED" in out
    publish(kafka_config, names, [make_group("ok", versions=(5,))])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, max_staleness=0,
                         policy_version=5) as c:
        c.take(1, timeout=30)  # step 0: the six skipped, then the good one
    trainer = status(kafka_config, names.namespace, trainer_group=group_id, timeout=5).trainer
    assert (trainer.last_step, trainer.policy_version, trainer.lag, trainer.waiting) == (0, 5, 0, None)
    skipped: Counter[str] = Counter()
    for kind in ("filtered", "requeued"):  # stale groups are requeued where their prompt can be
        skipped.update(trainer.recent.get(kind, {}))
    assert trainer.recent["taken"] == {"taken": 1} and skipped == {"all_rewards_equal": 3, "stale": 3}


def test_unreachable_cluster_is_reported_in_bounded_time() -> None:
    nowhere = KafkaConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", client_id="rollstream-tests")
    names = TopicNames(f"t-nowhere-{uuid.uuid4().hex[:6]}")
    started = time.monotonic()
    report = status(nowhere, names.namespace, timeout=2)
    assert time.monotonic() - started < 3.0
    assert set(report.unavailable) == {"producers", "prompts", "trainer"}
    assert report.producers is None and report.diagnosis.causes == () and not report.diagnosis.blocked
    assert "could not read prompts" in (report.diagnosis.note or "")
    diagnoser = TimeoutDiagnoser(nowhere, names, read_timeout_s=1.0)
    started = time.monotonic()
    pending = diagnoser.diagnose((), wait_s=0)  # timeout=0: starts the read, never waits for it
    assert time.monotonic() - started < 0.2 and "being read" in (pending.note or "") and pending.read_at_ms is None
    diagnosis = diagnoser.diagnose((), wait_s=2.0)  # waits for that read, which fails: named, not raised
    assert time.monotonic() - started < 2.5
    assert "could not read producers" in (diagnosis.note or "")
    assert diagnosis.seen == "looked at no group (none arrived)" and diagnosis.causes == ()
