"""Deterministic resumption against a real broker: the same batch after a crash, and seek_to_step.

Pinned here: with 3 partitions, a trainer SIGKILLed after an uncommitted take gets back exactly that
batch (ids, order, step number) on every one of 10 restarts, also two uncommitted steps in a row;
`seek_to_step(k)` continues exactly after step k, takes the steps after it again as the same batches
(whatever was committed later), rebuilds dedupe for that point, survives a crash in the middle of
the redo, and keeps the audit green; a recorded step that no longer fits the take is taken afresh, and so
is one that took a group of an older trainer run than the resuming consumer's (it is stale now), whether the
consumer rejects older runs through `stale` (with `max_staleness`) or `older_run` (without).
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace

import pytest
from rollstream.consumers import RolloutConsumer, audit, default_filters
from rollstream.consumers.filters import older_run
from rollstream.infra import KafkaConfig, LagReader, PolicyAnnouncer
from rollstream.schemas import PolicyVersion, RollstreamError

from tests.integration.test_consumer_restart import read_line, start_trainer
from tests.records import make_group, publish, publish_many


def consumer(kafka_config: KafkaConfig, names, group_id: str) -> RolloutConsumer:
    return RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace)


def committed(kafka_config: KafkaConfig, names, group_id: str) -> dict[int, int | None]:
    with LagReader(kafka_config) as reader:
        return {p.partition: p.committed for p in reader.group_lag(group_id, names.rollouts).partitions}


def spread(positions: list[tuple[int, int]]) -> set[int]:
    return {p for p, _ in positions}


def test_ten_restarts_after_an_uncommitted_take_rebuild_the_same_batch_with_3_partitions(
        bootstrap_servers, kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 10, prefix="early", partition=2)
    first = start_trainer(bootstrap_servers, names, group_id, 14)  # takes partition 2's ten, then waits
    try:
        time.sleep(4)
        # While it waits, partitions 0 and 1 fill: its batch is 10 of partition 2 and 4 of the others, which a
        # fresh consumer reading all three at once would not rebuild by itself.
        publish_many(kafka_config, names, 10, prefix="late0-", partition=0)
        publish_many(kafka_config, names, 10, prefix="late1-", partition=1)
        batches = [read_line(first)]
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    for _ in range(10):
        trainer = start_trainer(bootstrap_servers, names, group_id, 14)
        try:
            batches.append(read_line(trainer))  # taken with commit=False, then SIGKILLed
        finally:
            trainer.send_signal(signal.SIGKILL)
            trainer.wait(10)
    assert all(b == batches[0] for b in batches), batches  # ids, order and step number, 10 of 10 restarts
    assert batches[0]["step"] == 0 and len(batches[0]["ids"]) == 14
    with consumer(kafka_config, names, group_id) as c:
        again = c.take(14, timeout=30)
        assert again.group_ids == batches[0]["ids"] and len(spread(list(again.positions))) > 1
        after = c.take(5, timeout=30)
        assert after.step == 1 and not set(after.group_ids) & set(again.group_ids)
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.steps == (0, 1) and report.pending == ()


def test_two_uncommitted_steps_come_back_in_order(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 24)
    with consumer(kafka_config, names, group_id) as c:
        c.take(4, timeout=30)
        first, second = c.take(4, timeout=30, commit=False), c.take(4, timeout=30, commit=False)
    # Closed without committing: as after a crash, both are recorded, neither committed.
    assert audit(kafka_config, names.namespace, group_id).pending == (1, 2)
    with consumer(kafka_config, names, group_id) as c:
        a, b = c.take(4, timeout=30, commit=False), c.take(4, timeout=30, commit=False)
        assert (a.step, a.group_ids, a.positions) == (1, first.group_ids, first.positions)
        assert (b.step, b.group_ids, b.positions) == (2, second.group_ids, second.positions)
        c.commit(b)
        assert c.take(4, timeout=30).step == 3
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.steps == (0, 1, 2, 3)


def test_seek_to_step_continues_exactly_after_the_checkpointed_step(kafka_config, namespace_factory,
                                                                     group_id) -> None:
    names = namespace_factory(partitions=3)
    groups = publish_many(kafka_config, names, 30)
    with consumer(kafka_config, names, group_id) as c:
        steps = [c.take(4, timeout=30) for _ in range(5)]  # steps 0..4, all committed
        end_of_1 = steps[1].offsets
    # The trainer restores its checkpoint of step 1, although steps 2..4 were committed since.
    with consumer(kafka_config, names, group_id) as c:
        c.seek_to_step(1)
        assert c.position() == dict(end_of_1) and c.next_step == 2
        assert committed(kafka_config, names, group_id) == dict(end_of_1)  # lag and backpressure see it at once
        for old in steps[2:]:
            redo = c.take(4, timeout=30)
            assert (redo.step, redo.group_ids, redo.positions) == (old.step, old.group_ids, old.positions)
        fresh = c.take(4, timeout=30)  # then new groups, never one of steps 0..4 again
        assert fresh.step == 5 and not set(fresh.group_ids) & {g for s in steps for g in s.group_ids}
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.steps == (0, 1, 2, 3, 4, 5) and set(report.superseded) == {2, 3, 4}
    assert report.counts["taken"] == 24 and report.counts["duplicate"] == 0
    assert {g.group_id for g in groups} >= {g for s in steps for g in s.group_ids}


def test_a_crash_in_the_middle_of_the_redo_loses_nothing(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 24)
    with consumer(kafka_config, names, group_id) as c:
        steps = [c.take(4, timeout=30) for _ in range(4)]
    with consumer(kafka_config, names, group_id) as c:
        c.seek_to_step(0)
        assert c.take(4, timeout=30).group_ids == steps[1].group_ids
        c.take(4, timeout=30, commit=False)  # step 2 again, then the trainer dies before committing it
    with consumer(kafka_config, names, group_id) as c:  # restarted without a seek: from the committed step 1
        redone = [c.take(4, timeout=30) for _ in range(2)]
        assert [b.group_ids for b in redone] == [s.group_ids for s in steps[2:]]
        assert [b.step for b in redone] == [2, 3]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.steps == (0, 1, 2, 3) and report.counts["duplicate"] == 0


def test_a_recorded_step_of_another_size_is_taken_afresh(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 12)
    with consumer(kafka_config, names, group_id) as c:
        recorded = c.take(4, timeout=30, commit=False)
    with consumer(kafka_config, names, group_id) as c:
        bigger = c.take(6, timeout=30)  # the trainer's batch size changed: nothing to redo as recorded
        assert bigger.step == 0 and set(recorded.group_ids) <= set(bigger.group_ids) | {
            g for g in recorded.group_ids if g not in bigger.group_ids}
        rest = c.take(6, timeout=30)
        assert set(bigger.group_ids) | set(rest.group_ids) >= set(recorded.group_ids)
        assert not set(bigger.group_ids) & set(rest.group_ids)
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.counts["taken"] == 12 and report.counts["duplicate"] == 0


def test_seek_to_step_names_the_steps_it_knows(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    publish_many(kafka_config, names, 4)
    with consumer(kafka_config, names, group_id) as c:
        c.take(2, timeout=30)
        with pytest.raises(RollstreamError, match=r"has no step 7 .*steps 0\.\.0"):
            c.seek_to_step(7)
        assert c.take(2, timeout=30).step == 1  # nothing moved
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                         manifests=False) as c, pytest.raises(RollstreamError, match="manifests=True"):
        c.seek_to_step(0)


@pytest.mark.parametrize("max_staleness", [2, None], ids=["stale", "older_run-without-max_staleness"])
def test_a_new_run_takes_the_dead_runs_recorded_steps_afresh(kafka_config, namespace_factory, group_id,
                                                             max_staleness: int | None) -> None:
    """One rule for both ways a consumer rejects older runs: `stale` with a `max_staleness`, and `older_run` on its
    own (slime's, also without one)."""
    names = namespace_factory(partitions=1)
    filters = default_filters(dynamic_sampling=False) + (() if max_staleness is not None else (older_run,))

    def resumable(announcer: PolicyAnnouncer) -> RolloutConsumer:
        return RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                               max_staleness=max_staleness, filters=filters, announcer=announcer)

    dead = PolicyAnnouncer(kafka_config, names)
    dead_run = dead.announce(PolicyVersion(1)).run
    publish(kafka_config, names, [replace(make_group(f"d{i}", versions=(1,)), policy_run=dead_run) for i in range(8)])
    with resumable(dead) as c:
        steps = [c.take(4, timeout=30, policy_version=1) for _ in range(2)]  # step 1 after the checkpoint
    dead.close()
    resumed = PolicyAnnouncer(kafka_config, names)  # restored the checkpoint of step 0: a new run
    with resumed, resumable(resumed) as c:
        resumed.announce(PolicyVersion(1))  # the checkpoint's version, before it takes
        c.seek_to_step(0)
        publish(kafka_config, names, [replace(make_group(f"r{i}", versions=(1,)), policy_run=resumed.run)
                                      for i in range(4)])
        batch = c.take(4, timeout=30, policy_version=1)
    assert batch.step == 1 and batch.group_ids != steps[1].group_ids
    assert sorted(g.prompt_id for g in batch.groups) == [f"r{i}" for i in range(4)]
    dropped = [d for d in batch.dispositions if d.kind == "filtered"]
    assert [d.group_id for d in dropped] == steps[1].group_ids
    assert all(d.reason.startswith(f"stale: generated under trainer run {dead.run}") for d in dropped)
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
