"""Trainer restarts and long steps against a real broker.

Pinned here: a trainer SIGKILLed after take and before commit gets the same groups again, and after
commit never again; a crash between manifest and commit is re-taken under the same step number and
the audit stays clean; dedupe survives a restart; a trainer silent for longer than the session and
poll timeouts keeps its position and commits, where a subscribed consumer is thrown out.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from rollstream.consumers import RolloutConsumer, audit
from rollstream.infra import KafkaConfig

from tests.records import make_group, publish, publish_many

REPO = Path(__file__).resolve().parents[2]
TRAINER = Path(__file__).with_name("_rollouts.py")


def start_trainer(bootstrap: str, names, group_id: str, n: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(TRAINER), bootstrap, names.namespace, group_id, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)


def read_line(proc: subprocess.Popen[str]) -> dict:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, f"trainer exited with {proc.wait(5)} before answering"
    return json.loads(line)


def test_sigkill_between_take_and_commit(bootstrap_servers, kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 5)
    first = start_trainer(bootstrap_servers, names, group_id, 3)
    try:
        taken = read_line(first)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    assert taken == {"step": 0, "ids": [g.group_id for g in groups[:3]]}
    second = start_trainer(bootstrap_servers, names, group_id, 3)
    try:
        assert read_line(second) == taken  # same groups, same step: nothing was committed
        second.stdin.write("\n")  # type: ignore[union-attr]
        second.stdin.flush()  # type: ignore[union-attr]
        assert read_line(second) == {"committed": 0}
    finally:
        second.stdin.close()  # type: ignore[union-attr]
        assert second.wait(30) == 0
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        after = c.take(2, timeout=30)
    assert after.group_ids == [g.group_id for g in groups[3:]] and after.step == 1  # never the first 3 again
    assert audit(kafka_config, names.namespace, group_id).ok


def test_crash_between_manifest_and_commit_is_retaken_as_the_same_step(kafka_config, namespace_factory,
                                                                         group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 6)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(2, timeout=30)

        dying: list[object] = []

        def die(offsets, batch, timeout):  # the manifest is on NS.steps; the process dies before committing
            dying.append(batch)
            raise _Crash

        c._committer._commit_offsets = die  # type: ignore[method-assign]
        try:
            c.take(2, timeout=30)
            raise AssertionError("the simulated crash did not happen")
        except _Crash:
            orphan = dying[0]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.pending == (1,) and report.steps == (0,)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        again = c.take(2, timeout=30)  # not duplicates: the orphan manifest was never committed
        assert again.step == 1 and again.group_ids == orphan.group_ids == [g.group_id for g in groups[2:4]]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok and report.superseded == (1,) and report.steps == (0, 1) and report.pending == ()


def test_dedupe_across_a_restart(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    originals = publish_many(kafka_config, names, 4)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(4, timeout=30)
    # A producer crashed after publishing two groups but before committing their prompts: it
    # generates them again (same group ids, land after the originals), plus two new groups.
    regenerated = [make_group(g.prompt_id, producer_id="again") for g in originals[:2]]
    publish(kafka_config, names, regenerated + [make_group("new1"), make_group("new2")])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        batch = c.take(2, timeout=30)
    assert sorted(batch.group_ids) == ["new1#0", "new2#0"] and batch.step == 1
    duplicates = sorted(d.group_id for d in batch.dispositions if d.kind == "duplicate")
    assert duplicates == sorted(g.group_id for g in originals[:2])
    assert audit(kafka_config, names.namespace, group_id).ok


def test_a_long_gap_between_takes_keeps_position(kafka_config: KafkaConfig, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 4)
    short = {"session.timeout.ms": 3000, "heartbeat.interval.ms": 500, "max.poll.interval.ms": 4000}
    joined = threading.Event()
    subscribed = Consumer(kafka_config.consumer(f"{group_id}-subscribed", short))
    subscribed.subscribe([names.rollouts], on_assign=lambda *_: joined.set())
    try:
        while not joined.is_set():
            subscribed.poll(0.2)
        with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                             overrides=short) as c:
            first = c.take(2, timeout=30)
            threading.Event().wait(6.0)  # the "training step": past both the session and the poll timeouts
            second = c.take(2, timeout=30)  # same position, commits under the group id
            assert second.group_ids == [g.group_id for g in groups[2:]] and second.step == first.step + 1
            assert c.lag().total == 0
        # The subscribed consumer, silent just as long, was thrown out of its group.
        msg = subscribed.poll(5)
        assert msg is not None and msg.error() is not None and msg.error().code() == KafkaError._MAX_POLL_EXCEEDED
        try:
            subscribed.commit(offsets=[TopicPartition(names.rollouts, 0, 2)], asynchronous=False)
            raise AssertionError("a consumer evicted from its group could still commit")
        except KafkaException as exc:
            assert exc.args[0].code() in (KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION)
    finally:
        subscribed.close()


class _Crash(BaseException):
    """The process dying at that point: nothing in rollstream handles it."""
