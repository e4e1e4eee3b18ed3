"""Every offset accounted for, against a real broker: filters, garbage, manifests, replay, audit, the CLI.

Pinned here: each filter's reason and count; garbage bytes and unknown schemas are recorded, never
fatal; the manifest on NS.steps is the batch's; replaying a step gives the same ids and bytes; the
audit passes on honest history and names the first gap when offsets are committed past the manifests.
"""

from __future__ import annotations

import json

from confluent_kafka import Consumer, TopicPartition
from rollstream.consumers import RolloutConsumer, audit, replay_range, replay_since, replay_step
from rollstream.consumers._manifests import read_manifests
from rollstream.schemas import encode, now_ms
from typer.testing import CliRunner

from rollstream.cli import app
from tests.records import make_group, publish, publish_many

UNKNOWN_SCHEMA = b"\xc3\x01" + b"\x00" * 8 + b"written by a newer producer"


def test_every_disposition_is_recorded_and_counted(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    records = [make_group("ok1", versions=(9,)), b"\x00not avro", make_group("failed", status="failed"),
               make_group("unscored", rewards=(1.0, None)), make_group("equal", rewards=(0.5, 0.5)),
               make_group("stale", versions=(7,)), UNKNOWN_SCHEMA, make_group("ok1", producer_id="again"),
               make_group("ok2", versions=(10,))]
    publish(kafka_config, names, records)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, max_staleness=2) as c:
        batch = c.take(2, timeout=30, policy_version=10)
        registry = c.metrics.registry
    assert batch.group_ids == ["ok1#0", "ok2#0"]
    assert [(d.offset, d.kind, d.reason) for d in batch.dispositions if d.kind != "undecodable"] == [
        (0, "taken", None), (2, "filtered", "failed: engine exploded"), (3, "filtered", "reward_missing"),
        (4, "filtered", "all_rewards_equal"), (5, "filtered", "stale: 3 versions behind (max 2)"),
        (7, "duplicate", "group_id already taken"), (8, "taken", None)]
    garbage, unknown = [d for d in batch.dispositions if d.kind == "undecodable"]
    assert garbage.offset == 1 and "not a rollstream record" in (garbage.reason or "")
    assert unknown.offset == 6 and "unknown schema fingerprint 0000000000000000" in (unknown.reason or "")
    assert batch.counts() == {"taken": 2, "filtered": 4, "duplicate": 1, "undecodable": 2, "requeued": 0}
    value = registry.get_sample_value
    assert value("rollstream_consumer_groups_taken_total") == 2
    assert value("rollstream_consumer_groups_filtered_total", {"reason": "failed"}) == 1
    assert value("rollstream_consumer_groups_filtered_total", {"reason": "stale"}) == 1
    assert value("rollstream_consumer_groups_duplicate_total") == 1
    assert value("rollstream_consumer_records_undecodable_total") == 2
    assert value("rollstream_consumer_group_staleness_versions_count") == 2  # versions 9 and 10 at policy 10
    assert value("rollstream_consumer_take_seconds_count") == 1
    [manifest] = read_manifests(kafka_config, names.steps, group_id)
    assert manifest == batch.manifest() and manifest.policy_version == 10
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts == {"taken": 2, "filtered": 4, "duplicate": 1, "undecodable": 2, "requeued": 0}


def test_replay_of_a_step_is_the_same_groups_and_bytes(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    groups = [make_group(f"r{i}", rewards=(i, i + 1.0)) for i in range(9)] + [make_group("eq", rewards=(1, 1))]
    publish(kafka_config, names, groups)
    sent = {g.group_id: encode(g) for g in groups}
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(3, timeout=30)
        original = c.take(4, timeout=30)
    replayed = replay_step(kafka_config, names.namespace, group_id, original.step)
    assert [r.group.group_id for r in replayed.records] == original.group_ids  # same ids, same order
    assert [r.value for r in replayed.records] == [sent[gid] for gid in original.group_ids]  # same bytes
    assert [(r.partition, r.offset) for r in replayed.records] == list(original.positions)
    rebuilt = replayed.to_batch()
    assert rebuilt.groups == original.groups and rebuilt.to_tensors().input_ids.equal(original.to_tensors().input_ids)


def test_replay_by_offsets_and_time(kafka_config, namespace_factory, tmp_path) -> None:
    names = namespace_factory(partitions=1)
    before = now_ms() - 1000
    groups = publish_many(kafka_config, names, 5)
    publish(kafka_config, names, [b"garbage"])
    assert [r.offset for r in replay_range(kafka_config, names.namespace, {0: (1, 4)})] == [1, 2, 3]
    since = list(replay_since(kafka_config, names.namespace, before))
    assert [r.group.group_id for r in since[:5]] == [g.group_id for g in groups] and since[5].group is None
    assert list(replay_since(kafka_config, names.namespace, now_ms() + 60_000)) == []
    out = tmp_path / "range.jsonl"
    result = CliRunner().invoke(app, ["replay", "--namespace", names.namespace, "--from", "0:3", "--to", "0:6",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x.get("group_id") for x in lines] == ["p3#0", "p4#0", None] and "undecodable" in lines[2]
    assert lines[0]["samples"][1]["tokens"] == groups[3].samples[1].tokens.tolist() and lines[0]["offset"] == 3
    result = CliRunner().invoke(app, ["replay", "--namespace", names.namespace, "--since", "10m"])
    assert result.exit_code == 0 and len(result.stdout.splitlines()) == 6


def test_cli_take_lag_replay_and_audit(kafka_config, namespace_factory, group_id, tmp_path) -> None:
    names = namespace_factory(partitions=2)
    publish_many(kafka_config, names, 7)
    runner = CliRunner()
    common = ["--namespace", names.namespace, "--group", group_id]
    out = tmp_path / "taken.jsonl"
    result = runner.invoke(app, ["take", "-n", "3", "--steps", "2", "--timeout", "30", "--out", str(out), *common])
    assert result.exit_code == 0, result.output
    taken = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["step"] for t in taken] == [0, 0, 0, 1, 1, 1] and taken[0]["rewards"] == [0.0, 1.0]
    assert {"group_id", "prompt_id", "epoch", "rewards", "step"} == set(taken[0])
    result = runner.invoke(app, ["lag", *common])
    assert result.exit_code == 0 and "total lag 1" in result.stdout
    result = runner.invoke(app, ["replay", "--step", "1", *common])
    assert [json.loads(x)["group_id"] for x in result.stdout.splitlines()] == [t["group_id"] for t in taken[3:]]
    result = runner.invoke(app, ["audit", *common])
    assert result.exit_code == 0 and "OK: every committed offset" in result.stdout


def test_audit_fails_on_a_manufactured_gap(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    publish_many(kafka_config, names, 6)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(3, timeout=30)
    assert audit(kafka_config, names.namespace, group_id).ok
    rogue = Consumer(kafka_config.consumer(group_id))  # commits past offsets 3 and 4 without any manifest
    try:
        rogue.commit(offsets=[TopicPartition(names.rollouts, 0, 5)], asynchronous=False)
    finally:
        rogue.close()
    report = audit(kafka_config, names.namespace, group_id)
    assert not report.ok
    first = report.problems[0]
    assert (first.kind, first.partition, first.start, first.end, first.steps) == ("gap", 0, 3, 5, (0,))
    result = CliRunner().invoke(app, ["audit", "--namespace", names.namespace, "--group", group_id])
    assert result.exit_code == 1
    assert "FAILED: 1 problem(s); first: partition 0 offsets [3, 5): committed but in no step (after step 0)" \
        in result.stdout
