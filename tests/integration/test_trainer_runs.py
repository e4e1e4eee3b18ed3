"""Trainer runs on a real broker (`rollstream.infra.runs`): the newest run leads, the replaced one is fenced.

Pinned: a trainer resumed from a checkpoint (a new `PolicyAnnouncer`) moves every producer to its lower
version, a custom generate's samples are stamped with it (and the group with the run) and the HF engine
loads its (lower) weights; the replaced trainer can neither announce nor commit (`RunSupersededError`,
from the broker's fencing), also when it commits after the newer run already committed on its group (the
offsets moved under it: still `RunSupersededError`, not `GroupConflictError`); an announcement of a
superseded run that reaches NS.control anyway (a writer that bypassed the fencing) moves nobody and is
counted; the groups the dead run generated are stale for the resumed trainer and requeued, regenerated
under the new run, and the audit is green; `status` says what producers follow.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, audit, default_filters, status
from rollstream.infra import KafkaConfig, PolicyAnnouncer, RunSupersededError, TopicNames
from rollstream.infra.clients import open_producer
from rollstream.infra.kafka_io import produce_and_wait
from rollstream.producers import RolloutProducer
from rollstream.schemas import PolicyVersion, encode, write_policy_version

from tests import plugins
from tests.integration._kafka import count, read_all, write_prompts
from tests.integration.test_policy_versions import running, sample_logprobs_under, settings, wait_for


def _forge(config: KafkaConfig, names: TopicNames, version: PolicyVersion) -> None:
    """Write `version` to NS.control with a plain producer: what a writer that bypassed the fencing leaves."""
    producer = open_producer(config.producer({"linger.ms": 0}))
    produce_and_wait(producer, names.control, [(b"policy", encode(version))], timeout=15)


def test_a_resumed_run_leads_the_producers_and_the_replaced_one_is_fenced(
        kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    names = namespace_factory(partitions=2)
    dead = PolicyAnnouncer(kafka_config, names)
    producer = RolloutProducer(plugins.instant, settings(names), kafka=kafka_config, reward="tests.plugins:reward")
    with running(producer):
        for version in range(1, 7):  # the first run got to version 6 ...
            dead.announce(PolicyVersion(version))
        wait_for(lambda: producer.policy_version == 6, "the producer to follow run 1 to version 6")
        write_prompts(kafka_config, names, [f"dead-{i}" for i in range(4)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 4, "4 groups at run 1's version 6")

        resumed = PolicyAnnouncer(kafka_config, names)  # ... and the trainer resumed from its checkpoint of 4
        record = resumed.announce(PolicyVersion(4))
        assert dead.run is not None and (record.run, record.run_id) == (dead.run + 1, resumed.run_id)
        wait_for(lambda: producer.policy_version == 4, "the producer to follow the resumed run down to 4")

        with pytest.raises(RunSupersededError, match=f"trainer run {dead.run} of namespace {names.namespace}"):
            dead.announce(PolicyVersion(7))  # the replaced trainer comes back: the broker refuses it
        _forge(kafka_config, names, PolicyVersion(8, run=1, run_id=dead.run_id))  # ... and a bypass moves nobody
        superseded = producer.metrics.registry.get_sample_value
        wait_for(lambda: superseded("rollstream_producer_superseded_announcements_total") == 1,
                 "the producer to count the superseded announcement")
        assert producer.policy_version == 4
        assert producer.metrics.registry.get_sample_value("rollstream_producer_policy_run") == resumed.run
        trainer_status = status(kafka_config, names.namespace, trainer_group=group_id, timeout=10).trainer
        assert (trainer_status.followed_version, trainer_status.followed_run) == (4, resumed.run)
        assert trainer_status.superseded_announcements == 1  # the bypass; the refused announcement never landed

        # The resumed trainer: the dead run's groups (version 6, ahead of its 4) are stale and requeued;
        # their regenerations under run 2 (version 4) are what it takes.
        with resumed, RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                                      filters=default_filters(dynamic_sampling=False), max_staleness=2,
                                      announcer=resumed) as trainer:
            batch = trainer.take(4, timeout=60, policy_version=4)
    assert sorted(g.prompt_id for g in batch.groups) == [f"dead-{i}" for i in range(4)]
    assert all(s.weight_versions == (4,) for g in batch.groups for s in g.samples)
    assert all(g.attempt == 1 and g.policy_run == resumed.run for g in batch.groups)
    requeued = [d for d in batch.dispositions if d.kind == "requeued"]
    assert len(requeued) == 4 and all(d.reason == f"stale: generated under trainer run {dead.run}, superseded by "
                                      f"run {resumed.run}" for d in requeued)

    # The replaced trainer's consumer, bound to its run, cannot commit what it takes.
    with RolloutConsumer(config=kafka_config, group_id=f"{group_id}-dead", namespace=names.namespace,
                         filters=(), announcer=dead) as zombie:
        with pytest.raises(RunSupersededError, match="committing step 0"):
            zombie.take(1, timeout=30)
    dead.close()
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["requeued"] == 4 and report.counts["taken"] == 4


def test_the_newest_run_commits_and_a_replaced_trainer_is_stopped_at_its_next_commit(
        kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    names = namespace_factory(partitions=1)
    write_prompts(kafka_config, names, [f"p{i}" for i in range(6)])
    producer = RolloutProducer(plugins.instant, settings(names), kafka=kafka_config, reward="tests.plugins:reward")
    with running(producer):
        wait_for(lambda: count(kafka_config, names.rollouts) >= 6, "6 groups")
    first = PolicyAnnouncer(kafka_config, names)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=(),
                         announcer=first) as old:
        committed = old.take(2, timeout=30)  # its run begins at this commit
        second = PolicyAnnouncer(kafka_config, names)
        second.begin()  # a restarted trainer begins its run before it takes: from now on the old one is fenced
        with pytest.raises(RunSupersededError, match="committing step 1"):
            old.take(2, timeout=30)
    with second, RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=(),
                                 announcer=second) as new:
        again = new.take(2, timeout=30)  # the step the old run could not commit comes back: nothing is lost
        rest = new.take(2, timeout=30)
    assert again.step == 1 and rest.step == 2
    taken = [g.prompt_id for b in (committed, again, rest) for g in b.groups]
    assert sorted(taken) == [f"p{i}" for i in range(6)]
    first.close()
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["taken"] == 6


def test_a_replaced_trainer_that_commits_after_the_newer_run_committed_is_told_it_was_superseded(
        kafka_config: KafkaConfig, namespace_factory, group_id: str) -> None:
    from tests.records import publish_many

    names = namespace_factory(partitions=1)
    groups = [g.group_id for g in publish_many(kafka_config, names, 6)]

    def trainer(run: PolicyAnnouncer) -> RolloutConsumer:
        return RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=(),
                               announcer=run)

    with PolicyAnnouncer(kafka_config, names) as first, trainer(first) as old:
        assert old.take(2, timeout=30).group_ids == groups[:2]  # its run begins at this commit
        with PolicyAnnouncer(kafka_config, names) as second, trainer(second) as new:
            assert new.take(2, timeout=30).group_ids == groups[2:4]  # begins the newer run, moves the group
            with pytest.raises(RunSupersededError, match=f"committing step 1 of group {group_id} refused: trainer "
                                                         f"run {first.run} of namespace {names.namespace} was "
                                                         "superseded by a newer trainer run"):
                old.take(2, timeout=30)
            assert first.superseded
            assert new.take(2, timeout=30).group_ids == groups[4:6]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.counts["taken"] == 6, report.summary()


def test_the_hf_engine_loads_a_resumed_runs_lower_version(kafka_config: KafkaConfig, namespace_factory,
                                                          tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollstream.producers import HFEngine

    from rollstream.demo.task import build_demo_model

    names = namespace_factory(partitions=1)
    v0 = build_demo_model(tmp_path / "v0", seed=0)
    write_policy_version(v0, 0)
    v1 = build_demo_model(tmp_path / "v1", seed=1)
    v2 = build_demo_model(tmp_path / "v2", seed=2)
    engine = HFEngine(v0, torch_threads=1)
    producer = RolloutProducer(engine, settings(names), kafka=kafka_config, reward="rollstream.demo.task:reward")
    with running(producer), PolicyAnnouncer(kafka_config, names) as dead, \
            PolicyAnnouncer(kafka_config, names) as resumed:
        dead.announce(PolicyVersion(2, weights_path=str(v2)))
        wait_for(lambda: engine.policy_version == 2, "the producer to load run 1's version 2")
        resumed.announce(PolicyVersion(1, weights_path=str(v1)))
        wait_for(lambda: engine.policy_version == 1, "the producer to load the resumed run's version 1")
        write_prompts(kafka_config, names, [f"after-{i}" for i in range(2)], label="9")
        wait_for(lambda: count(kafka_config, names.rollouts) >= 2, "2 groups from version 1")
    groups = read_all(kafka_config, names.rollouts)
    assert len(groups) == 2 and all(g.status == "ok" for g in groups)
    for group in groups:
        assert {s.weight_versions for s in group.samples} == {(1,)}
        for sample, expected in zip(group.samples, sample_logprobs_under(v1, group), strict=True):
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)  # v1's weights, not v2's
