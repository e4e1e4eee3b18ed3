"""take(n) against a real broker: the fully-async fix's cases restated for Kafka.

Pinned here: (1) exactly n, FIFO per partition, the surplus kept for the next take, commits only the
taken prefix; (2) limit semantics: only n - gathered records are pulled per take, nothing piles up in
the process; (3) never blocking past the timeout, and a timeout loses nothing; (4) commit=False +
commit(batch) later, taking past an uncommitted batch; checkpoints with position/seek_to.
"""

from __future__ import annotations

import io
import json
import time

import fastavro
import pytest
from rollstream.consumers import RolloutConsumer, TakeTimeout, audit
from rollstream.infra import KafkaConfig, LagReader
from rollstream.schemas import Sample, ScoredGroup, decode, default_codec, encode
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR, fingerprint

from tests.records import make_group, publish, publish_many


def consumer(kafka_config: KafkaConfig, names, group_id: str, **kw) -> RolloutConsumer:
    return RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, **kw)


def committed(kafka_config: KafkaConfig, names, group_id: str) -> dict[int, int | None]:
    with LagReader(kafka_config) as reader:
        return {p.partition: p.committed for p in reader.group_lag(group_id, names.rollouts).partitions}


def test_exact_target_fifo_with_surplus_kept_on_one_partition(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 10)
    with consumer(kafka_config, names, group_id) as c:
        first = c.take(4, timeout=30)
        assert first.group_ids == [g.group_id for g in groups[:4]] and first.step == 0
        assert committed(kafka_config, names, group_id) == {0: 4}  # exactly the taken prefix
        second = c.take(6, timeout=30)  # the 6 left over come next, in order: none dropped
        assert second.group_ids == [g.group_id for g in groups[4:]] and second.step == 1
        assert committed(kafka_config, names, group_id) == {0: 10}
        assert [tuple(p) for p in second.positions] == [(0, o) for o in range(4, 10)]


def test_exact_target_over_three_partitions(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    groups = [make_group(f"q{i}") for i in range(12)]
    positions = dict(zip([g.group_id for g in groups], publish(kafka_config, names, groups), strict=True))
    with consumer(kafka_config, names, group_id) as c:
        batches = [c.take(5, timeout=30), c.take(7, timeout=30)]
    taken = [gid for b in batches for gid in b.group_ids]
    assert sorted(taken) == sorted(positions) and len(taken) == 12  # every group exactly once
    for b in batches:
        assert [positions[gid] for gid in b.group_ids] == list(b.positions)
        for r in b.ranges:  # per partition a contiguous run of offsets, taken in offset order
            offsets = [o for p, o in b.positions if p == r.partition]
            assert offsets == sorted(offsets) == list(range(r.start, r.end))
    ends: dict[int, int] = {}
    for p, o in positions.values():
        ends[p] = max(ends.get(p, 0), o + 1)
    assert committed(kafka_config, names, group_id) == ends
    assert audit(kafka_config, names.namespace, group_id).ok


def test_limit_semantics_nothing_piles_up_in_the_process(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=3)
    publish_many(kafka_config, names, 60)
    with consumer(kafka_config, names, group_id) as c:
        for _ in range(5):
            assert len(c.take(4, timeout=30)) == 4
            assert c.buffered() == 0  # pulled only target - gathered; the rest waits in Kafka, not here
        assert sum(c.position().values()) == 20
        assert c.lag().total == 40


def test_a_timeout_never_blocks_longer_and_loses_nothing(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    early = publish_many(kafka_config, names, 3, prefix="early")
    with consumer(kafka_config, names, group_id) as c:
        started = time.monotonic()
        with pytest.raises(TakeTimeout) as info:
            c.take(5, timeout=2)
        assert 1.9 <= time.monotonic() - started < 4.5
        assert (info.value.wanted, info.value.gathered, info.value.retriable) == (5, 3, True)
        assert c.buffered() == 3 and committed(kafka_config, names, group_id) == {0: None}
        started = time.monotonic()
        with pytest.raises(TakeTimeout):
            c.take(5, timeout=0)  # timeout=0 never waits
        assert time.monotonic() - started < 0.5
        late = publish_many(kafka_config, names, 2, prefix="late")
        batch = c.take(5, timeout=30)
        assert batch.group_ids == [g.group_id for g in early + late] and batch.step == 0


def test_commit_later_and_take_past_an_uncommitted_batch(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 9)
    with consumer(kafka_config, names, group_id) as c:
        a = c.take(3, timeout=30, commit=False)
        b = c.take(3, timeout=30, commit=False)  # continues after a: the position is in memory
        assert b.group_ids == [g.group_id for g in groups[3:6]] and (a.step, b.step) == (0, 1)
        assert committed(kafka_config, names, group_id) == {0: None} and c.pending() == [a, b]
        c.commit(a)
        assert committed(kafka_config, names, group_id) == {0: 3}
        c.commit(b)
        c.commit(a)  # already committed: nothing to do
        assert committed(kafka_config, names, group_id) == {0: 6} and c.pending() == []
        checkpoint = {"offsets": dict(b.offsets), "step": b.step}
        c.take(3, timeout=30)
    with consumer(kafka_config, names, group_id) as restored:  # restore a trainer checkpoint of step 1
        restored.seek_to(checkpoint["offsets"], next_step=checkpoint["step"] + 1)
        again = restored.take(3, timeout=30)
        assert again.group_ids == [g.group_id for g in groups[6:]] and again.step == 2
    report = audit(kafka_config, names.namespace, group_id)  # the re-taken step 2 supersedes the first one
    assert report.ok and report.steps == (0, 1, 2) and report.superseded == (2,), report.summary()


def test_the_consumer_sizes_itself_from_the_topic_not_its_default(kafka_config, namespace_factory,
                                                                  group_id) -> None:
    """Topics made with a larger --max-message-mib than the clients' 64 MiB default: a record above 64 MiB
    still reaches the trainer, because the consumer takes its fetch limits from the topic."""
    import numpy as np
    from rollstream.infra.topics import sized_to_topic
    from rollstream.schemas import Sample, ScoredGroup, make_group_id

    names = namespace_factory(partitions=1, max_message_bytes=80 * 1024 * 1024)
    tokens = np.arange(17 * 1024 * 1024, dtype=np.int32)  # 68 MiB of packed tokens: above the default
    big = ScoredGroup(group_id=make_group_id("huge", 0), prompt_id="huge", epoch=0, prompt_tokens=[1],
                      samples=[Sample(tokens=tokens, reward=1.0)], started_at_ms=1, finished_at_ms=2)
    publish(sized_to_topic(kafka_config, names.rollouts), names, [big])
    assert kafka_config.max_message_bytes == 64 * 1024 * 1024
    with consumer(kafka_config, names, group_id) as c:
        batch = c.take(1, timeout=60)
        assert c.config.max_message_bytes == 80 * 1024 * 1024
    assert np.array_equal(batch.groups[0].samples[0].tokens, tokens)


def test_a_second_trainer_on_the_same_group_is_stopped_before_it_writes_anything(kafka_config, namespace_factory,
                                                                                 group_id) -> None:
    """Consumers that do not fence (``fence=False``): the offsets check is what keeps them apart. (Fencing ones: the
    newer one wins, tests/integration/test_take_takeover.py.)"""
    from rollstream.consumers import GroupConflictError

    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 6)
    with consumer(kafka_config, names, group_id, fence=False) as first, \
            consumer(kafka_config, names, group_id, fence=False) as second:
        first.position(), second.position()  # both started: both read committed = nothing
        assert first.take(2, timeout=30).group_ids == [g.group_id for g in groups[:2]]
        # The same two groups: that is the hazard. Caught when the step would be recorded, before its manifest.
        with pytest.raises(GroupConflictError, match="partition 0 is at 2, expected None") as err:
            second.take(2, timeout=30, commit=False)
        twin = err.value.batch
        assert twin.group_ids == [g.group_id for g in groups[:2]] and not err.value.retriable
        with pytest.raises(GroupConflictError, match="partition 0 is at 2, expected None"):
            second.commit(twin)  # and at the commit too
        assert committed(kafka_config, names, group_id) == {0: 2}  # the second wrote nothing
        assert first.take(2, timeout=30).group_ids == [g.group_id for g in groups[2:4]]  # the first goes on
    with consumer(kafka_config, names, group_id) as after:  # a fresh consumer reads the offsets afresh
        assert after.take(2, timeout=30).group_ids == [g.group_id for g in groups[4:]]
    assert audit(kafka_config, names.namespace, group_id).ok


def _v2_sample(s: Sample) -> dict[str, object]:
    """A sample as schema v2 wrote it: one record per sample, arrays packed as bytes."""
    return {"tokens": s.tokens.tobytes(), "logprobs": None if s.logprobs is None else s.logprobs.tobytes(),
            "text": s.text, "reward": s.reward, "finish_reason": s.finish_reason,
            "weight_versions": list(s.weight_versions)}


def test_groups_written_by_an_older_producer_are_taken_with_the_new_ones(kafka_config, namespace_factory,
                                                                          group_id) -> None:
    """Schema v2 wrote one record per sample; v3 writes columns. A topic holding both is read in order."""
    names = namespace_factory(partitions=1)
    old, new = make_group("old", rewards=(0.0, 1.0)), make_group("new", rewards=(1.0, 0.0), logprobs=False)
    v2 = fastavro.parse_schema(json.loads((SCHEMA_DIR / "history" / "scored_group.v2.avsc").read_text()))
    body = io.BytesIO()
    current = fastavro.schemaless_reader(io.BytesIO(encode(old)[10:]), default_codec().schema(ScoredGroup), None)
    fastavro.schemaless_writer(body, v2, {**{k: v for k, v in current.items() if k in {
        "group_id", "prompt_id", "epoch", "prompt", "producer_id", "started_at_ms", "finished_at_ms", "status",
        "error", "metadata"}}, "prompt_tokens": old.prompt_tokens.tobytes(),
        "samples": [_v2_sample(s) for s in old.samples]})
    v2_bytes = MAGIC + fingerprint(v2) + body.getvalue()
    assert encode(old) != v2_bytes and decode(v2_bytes) == old
    publish(kafka_config, names, [v2_bytes, new])
    with consumer(kafka_config, names, group_id) as c:
        batch = c.take(2, timeout=30)
    assert [g.group_id for g in batch.groups] == ["old#0", "new#0"]
    assert batch.groups[0] == old and batch.groups[1] == new and batch.counts()["undecodable"] == 0
    assert batch.groups[0].samples[1].tokens.tolist() == old.samples[1].tokens.tolist()
