"""A trainer and a producer never wedge after a broker stall (trainer: librdkafka#5511).

A single-node broker frozen (SIGSTOP) for longer than its broker session fences itself briefly on SIGCONT
and its group coordinator reloads every group; librdkafka 2.16 can then lose its coordinator for good,
so every committed-offsets lookup and commit of that client times out while fetches keep working. The
trainer must recover by itself (a fresh client at the position it holds) instead of failing every commit.

Pinned here, against a real broker, for each of several stalls longer than the broker session: a step
taken just before the broker froze is committed within a bound after it resumes, retrying as
`CommitError` advises, and the consumer replaced its client on the way (it cannot know whether the old
one would ever recover); afterwards every group is taken exactly once and the audit is green.
``ROLLSTREAM_TEST_STALLS`` / ``ROLLSTREAM_TEST_STALL_S`` make it longer (the issue's ten stalls of 20-30 s).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from rollstream.consumers import Batch, CommitError, RolloutConsumer, audit
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.producers import ProducerSettings, RolloutProducer

from tests import plugins
from tests.integration._kafka import committed_everything, count, lag, read_all, signal_all, until, write_prompts
from tests.records import publish_many

STALLS = int(os.environ.get("ROLLSTREAM_TEST_STALLS", "2"))
STALL_S = float(os.environ.get("ROLLSTREAM_TEST_STALL_S", "12"))  # > the broker session (9 s by default)
RECOVERY_BOUND_S = 60.0
N = 4


def _commit_until_done(consumer: RolloutConsumer, batch: Batch, deadline: float) -> list[str]:
    """Commit as `CommitError` advises (retry `commit(err.batch)`) until it succeeds; return the errors."""
    errors: list[str] = []
    while True:
        try:
            consumer.commit(batch)
            return errors
        except CommitError as exc:
            errors.append(str(exc))
            if time.monotonic() > deadline:
                raise AssertionError(f"still not committed; last errors: {errors[-3:]}") from exc
            time.sleep(0.5)


def _stall(pids: tuple[int, ...]) -> threading.Timer:
    """Freeze the broker now; it resumes after STALL_S (join the returned timer to wait for that)."""
    signal_all(pids, signal.SIGSTOP)
    resume = threading.Timer(STALL_S, signal_all, (pids, signal.SIGCONT))
    resume.start()
    return resume


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_commits_again_after_broker_stalls(freezable_broker: tuple[KafkaConfig, tuple[int, ...]]) -> None:
    config, pids = freezable_broker
    names = TopicNames("stall-trainer")
    try:
        create_topics(TopicPlan(names=names, partitions=2), config)
        groups = publish_many(config, names, N * (STALLS + 3))
        taken: list[str] = []
        with RolloutConsumer(config=config, group_id="stall-trainer", namespace=names.namespace, filters=(),
                             timeout=10.0) as consumer:
            replaced = consumer.metrics.registry.get_sample_value
            for stall in range(STALLS):
                batch = consumer.take(N, timeout=30, commit=False)  # taken, then the broker freezes
                resume = _stall(pids)
                try:
                    errors = _commit_until_done(consumer, batch, time.monotonic() + STALL_S + RECOVERY_BOUND_S)
                finally:
                    resume.join()
                assert errors, "the commit never failed: the stall did not happen"
                replacements = replaced("rollstream_consumer_client_replacements_total") or 0
                assert replacements >= stall + 1, f"no fresh client during stall {stall + 1}: {errors[-3:]}"
                taken += batch.group_ids
            while len(taken) < len(groups):  # the rest, after the stalls: nothing skipped, nothing twice
                batch = consumer.take(N, timeout=30, commit=False)
                _commit_until_done(consumer, batch, time.monotonic() + RECOVERY_BOUND_S)
                taken += batch.group_ids
        assert sorted(taken) == sorted(g.group_id for g in groups)
        report = audit(config, names.namespace, "stall-trainer")
        assert report.ok, report.summary()
    finally:
        signal_all(pids, signal.SIGCONT)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_producer_publishes_and_commits_again_after_broker_stalls(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]]) -> None:
    """The producer's clients (prompt intake: a group member that commits; the publisher; the lag gate)
    come back after stalls too: every prompt loaded before, during and after is published and its
    offset committed, within a bound after the last stall."""
    config, pids = freezable_broker
    names = TopicNames("stall-producer")
    create_topics(TopicPlan(names=names, partitions=2), config)
    settings = ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=4, max_lag=10**6,
                                lag_interval_s=0.2, summary_interval_s=0, watch_control=False)
    producer = RolloutProducer(plugins.slow, settings, kafka=config)
    done = threading.Event()
    runner = threading.Thread(target=lambda: (producer.run_sync(handle_signals=False), done.set()), daemon=True)
    ids: list[str] = []
    try:
        runner.start()
        for stall in range(STALLS):
            batch = [f"s{stall}-{i}" for i in range(20)]
            write_prompts(config, names, batch)
            ids += batch
            expected = len(ids) - 10
            until(lambda: count(config, names.rollouts) >= expected, 60, "groups before the stall")  # noqa: B023
            _stall(pids).join()
        write_prompts(config, names, [f"after-{i}" for i in range(20)])
        ids += [f"after-{i}" for i in range(20)]
        until(lambda: committed_everything(config, f"{names.namespace}.producers", names.prompts),
              RECOVERY_BOUND_S, "every prompt committed after the stalls")
        published = {g.prompt_id for g in read_all(config, names.rollouts)}
        assert published == set(ids)  # nothing lost (a regenerated duplicate would be allowed)
        assert lag(config, f"{names.namespace}.producers", names.prompts) == 0
    finally:
        signal_all(pids, signal.SIGCONT)
        producer.stop()
        runner.join(60)
    assert done.is_set(), "the producer did not stop"
