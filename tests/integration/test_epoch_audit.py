"""The epoch audit against a real broker: every loaded prompt taken exactly once, terminal, in flight or a problem.

States are built as the system builds them: prompts loaded on NS.prompts (`publish_prompts`, what
`rollstream prompts load` calls), groups published by a plain producer, the producers' offsets on NS.prompts
committed by a consumer of their group (what a producer does once a group is acknowledged), groups taken by
`RolloutConsumer`. Pinned here: taken once and terminal are ok; not generated, published-not-taken and taken
in an uncommitted step are in flight (exit 0, listed apart); a committed prompt with no group anywhere, a
group taken twice and a prompt loaded twice are problems (exit 1 naming the prompt); a requeue holds its
prompt in flight until the regenerated group is taken.
"""

from __future__ import annotations

import json
from dataclasses import replace

from confluent_kafka import Consumer
from rollstream.consumers import RolloutConsumer, audit_epochs
from rollstream.consumers.forensics._epoch_audit import EpochSnapshot, PromptRecord, judge
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.kafka_io import commit_offsets
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import OffsetDisposition, PartitionRange, Prompt, StepManifest, encode
from typer.testing import CliRunner

from rollstream.cli import app
from tests.integration._kafka import end_offsets
from tests.records import make_group, publish


def load(config: KafkaConfig, names: TopicNames, ids: list[str], *, epochs: int = 1) -> None:
    publish_prompts([Prompt(id=i, prompt=f"question {i}") for i in ids], config, names.prompts, epochs=epochs)


def commit_producers(config: KafkaConfig, names: TopicNames, offsets: dict[int, int] | None = None) -> None:
    """Commit the producers' group on NS.prompts (default: everything there, as if all was generated)."""
    consumer = Consumer(config.consumer(names.producer_group))
    try:
        commit_offsets(consumer, names.prompts, end_offsets(config, names.prompts) if offsets is None else offsets)
    finally:
        consumer.close()


def cli_audit(names: TopicNames, group: str, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["audit", "--epochs", "--namespace", names.namespace, "--group", group, *extra])
    return result.exit_code, result.stdout


def test_every_prompt_taken_once_is_ok(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    ids = [f"q{i}" for i in range(4)]
    load(kafka_config, names, ids, epochs=2)
    publish(kafka_config, names, [make_group(i, e) for e in (0, 1) for i in ids])
    commit_producers(kafka_config, names)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(4, timeout=30)
        c.take(4, timeout=30)
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert report.ok and not report.in_flight, report.summary()
    assert [(e.epoch, e.loaded, e.taken, e.terminal, e.in_flight) for e in report.epochs] == [
        (0, 4, 4, {}, 0), (1, 4, 4, {}, 0)]
    code, out = cli_audit(names, group_id)
    assert code == 0, out
    assert "OK: every committed offset" in out and "OK: every prompt of 2 epoch(s) taken exactly once" in out
    code, out = cli_audit(names, group_id, "--json")
    parsed = json.loads(out)
    assert code == 0 and parsed["ok"] and parsed["epochs"]["epochs"][1]["taken"] == 4


def test_a_terminally_filtered_prompt_is_ok(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    load(kafka_config, names, ["a", "b", "c"])
    publish(kafka_config, names, [make_group("a"), make_group("b", rewards=(0.5, 0.5)), make_group("c")])
    commit_producers(kafka_config, names)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        batch = c.take(2, timeout=30)
    assert batch.counts()["filtered"] == 1
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    [epoch] = report.epochs
    assert (epoch.loaded, epoch.taken, epoch.terminal, epoch.in_flight) == (3, 2, {"all_rewards_equal": 1}, 0)
    assert "terminal 1 (all_rewards_equal 1)" in report.summary()


def test_prompts_in_flight_are_listed_apart_and_pass(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    load(kafka_config, names, ["a", "b", "c", "d"])
    commit_producers(kafka_config, names, {0: 3})  # a, b, c generated; d (offset 3) not yet
    publish(kafka_config, names, [make_group("a"), make_group("b"), make_group("c")])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(1, timeout=30)  # a: taken, committed
        c.take(1, timeout=30, commit=False)  # b: taken in step 1, its manifest written, never committed
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert [(p.group_id, p.why) for p in report.in_flight] == [
        ("b#0", "in step 1, written but not committed yet (will be taken again)"),
        ("c#0", "published at rollouts[0]@2, not taken yet"),
        ("d#0", f"not generated yet: prompts[0]@3 is not committed by {names.producer_group}")]
    assert (report.epochs[0].taken, report.epochs[0].in_flight) == (1, 3)
    code, out = cli_audit(names, group_id)
    assert code == 0, out
    assert "3 still in flight" in out and "in flight, not a failure (3):" in out and "  d#0: not generated" in out


def test_a_committed_prompt_with_no_group_is_lost(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    load(kafka_config, names, ["a", "b"])
    commit_producers(kafka_config, names)  # the producers say both were generated, but b's group is nowhere
    publish(kafka_config, names, [make_group("a")])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        c.take(1, timeout=30)
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert not report.ok
    lost = ("prompt b epoch 0: no group taken, none terminal, nothing in flight (its prompt record at "
            "prompts[0]@1 is committed by the producers)")
    assert [(p.kind, p.prompt_id, p.message) for p in report.problems] == [("lost", "b", lost)]
    code, out = cli_audit(names, group_id)
    assert code == 1
    assert "OK: every committed offset" in out  # the offset audit is green: the loss is the epoch audit's
    assert f"FAILED: {lost} (1 problem(s))" in out


def test_taken_twice_and_loaded_twice_are_problems(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    load(kafka_config, names, ["a", "b"])
    load(kafka_config, names, ["b"])  # b loaded again into epoch 0
    commit_producers(kafka_config, names)
    publish(kafka_config, names, [make_group("a"), make_group("b"), make_group("a", producer_id="regenerated")])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, dedupe=False) as c:
        c.take(2, timeout=30)
        c.take(1, timeout=30)  # the regenerated copy of a, taken again: dedupe is off
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert [(p.kind, p.prompt_id, p.steps) for p in report.problems] == [("taken_twice", "a", (0, 1)),
                                                                         ("loaded_twice", "b", ())]
    assert report.problems[0].message == "prompt a epoch 0: taken 2 times (steps 0, 1)"
    assert report.problems[1].message == "prompt b epoch 0: loaded 2 times (prompts[0]@1, prompts[0]@2)"
    code, out = cli_audit(names, group_id)
    assert code == 1 and "FAILED: prompt a epoch 0: taken 2 times" in out


def test_a_requeued_prompt_is_in_flight_until_its_regenerated_group_is_taken(kafka_config, namespace_factory,
                                                                             group_id) -> None:
    names = namespace_factory(partitions=1)
    load(kafka_config, names, ["r", "a"])
    commit_producers(kafka_config, names)
    source = encode(Prompt(id="r", prompt="question r"))
    stale = replace(make_group("r", versions=(1,)), max_attempts=3, source_prompt=source)
    publish(kafka_config, names, [stale, make_group("a", versions=(5,))])
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, max_staleness=0,
                         policy_version=5) as c:
        batch = c.take(1, timeout=30)  # r is stale: requeued as attempt 1 on NS.prompts; a is taken
        assert [d.kind for d in batch.dispositions] == ["requeued", "taken"]
        report = audit_epochs(kafka_config, names.namespace, group_id)
        assert report.ok, report.summary()
        assert [(p.group_id, p.why) for p in report.in_flight] == [
            ("r#0", f"not generated yet: prompts[0]@2 (attempt 1) is not committed by {names.producer_group}")]
        assert (report.epochs[0].requeued, report.epochs[0].requeue_prompts) == (1, 1)
        publish(kafka_config, names, [replace(stale, attempt=1, samples=make_group("r", versions=(5,)).samples)])
        commit_producers(kafka_config, names)
        assert c.take(1, timeout=30).group_ids == ["r#0"]
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert report.ok and not report.in_flight, report.summary()
    e = report.epochs[0]
    assert (e.loaded, e.taken, e.in_flight, e.requeued, e.requeue_prompts) == (2, 2, 0, 1, 1)


def test_judge_on_hand_built_manifests() -> None:
    """The classification alone: requeued then terminal, a pending step, a requeue lost once generated."""
    def disp(offset: int, kind: str, gid: str, attempt: int = 0, reason: str | None = None) -> OffsetDisposition:
        return OffsetDisposition(0, offset, kind, group_id=gid, reason=reason, attempt=attempt)  # type: ignore[arg-type]

    def step(n: int, start: int, *dispositions: OffsetDisposition) -> StepManifest:
        return StepManifest(n, "g", "ns.rollouts", (PartitionRange(0, start, start + len(dispositions)),),
                            dispositions)

    stale = "stale: 3 versions behind (max 1)"
    steps = [step(0, 0, disp(0, "requeued", "x#0", reason=stale), disp(1, "taken", "y#0"),
                  disp(2, "requeued", "z#0", reason=stale), disp(3, "undecodable", "k")),
             step(1, 4, disp(4, "filtered", "x#0", 1, f"{stale} (attempt 2 of 2: the last)"), disp(5, "taken", "w#0")),
             step(2, 6, disp(6, "taken", "v#0"))]  # written, not committed: pending
    prompts = [PromptRecord(1, o, pid, 0) for o, pid in enumerate("xyzwv")]
    prompts += [PromptRecord(1, 5, "x", 0, 1), PromptRecord(1, 6, "z", 0, 1)]
    report = judge(EpochSnapshot("ns", "g", "ns.producers", prompts, {1: 7}, steps, {0: 6}))
    assert [(p.group_id, p.why) for p in report.in_flight] == [
        ("v#0", "in step 2, written but not committed yet (will be taken again)")]
    assert [p.message for p in report.problems] == [
        "prompt z epoch 0: no group taken, none terminal, nothing in flight (its prompt record at prompts[1]@6, "
        "attempt 1, is committed by the producers)"]
    [e] = report.epochs
    assert (e.loaded, e.taken, e.terminal, e.in_flight, e.requeued, e.requeue_prompts, e.problems) == (
        5, 2, {"stale": 1}, 1, 2, 2, 1)
    assert report.summary().splitlines()[0].startswith("FAILED: prompt z epoch 0: no group taken")
    assert "note: 1 undecodable record(s) accounted in effective steps (no prompt)" in report.notes
