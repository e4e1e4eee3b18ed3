"""A start reads its own group's manifests from NS.steps, not everyone's: the bound, against a real broker.

Pinned here: with thousands of other groups' manifests on NS.steps (before, between and after this group's),
a restarted consumer and `seek_to_step` fetch only this group's manifests (counted in records, not time), and
still rebuild everything the guarantees need (the uncommitted step again as recorded, dedupe, step numbers);
commits without the index (an older rollstream) fall back to reading everything, and the next commit adds it.
"""

from __future__ import annotations

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from rollstream.consumers import RolloutConsumer
from rollstream.consumers import _resume as resume_module
from rollstream.consumers._manifests import ManifestRead, read_group_manifests
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.schemas import OffsetDisposition, PartitionRange, StepManifest, encode

from tests.integration._kafka import end_offsets
from tests.records import publish_many

OTHERS = 3000  # more than MERGE_GAP: this group's manifests are ranges of their own


def write_others(config: KafkaConfig, names: TopicNames, count: int, tag: str) -> None:
    """`count` small manifests of other groups on NS.steps (keyed by their group, as trainers write them)."""
    producer = Producer(config.producer())
    for i in range(count):
        group = f"other-{tag}-{i % 7}"
        m = StepManifest(i, group, names.rollouts, (PartitionRange(0, i, i + 1),),
                         (OffsetDisposition(0, i, "taken", f"x{i}#0"),))
        producer.produce(names.steps, key=group.encode(), value=encode(m))
        if i % 1000 == 999:
            producer.poll(0)
    assert producer.flush(30) == 0


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[ManifestRead]:
    """Every manifest read a consumer makes (at start and in `seek_to_step`), as it made it."""
    seen: list[ManifestRead] = []

    def spy(*args: object, **kwargs: object) -> ManifestRead:
        read = read_group_manifests(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(read)
        return read

    monkeypatch.setattr(resume_module, "read_group_manifests", spy)
    return seen


def consumer(config: KafkaConfig, names: TopicNames, group_id: str) -> RolloutConsumer:
    return RolloutConsumer(config=config, group_id=group_id, namespace=names.namespace)


def test_a_start_and_seek_to_step_read_only_this_groups_manifests(kafka_config, namespace_factory, group_id,
                                                                  reads) -> None:
    names = namespace_factory(partitions=2)
    publish_many(kafka_config, names, 40)
    write_others(kafka_config, names, OTHERS, "before")
    with consumer(kafka_config, names, group_id) as c:
        first = c.take(4, timeout=30)
        write_others(kafka_config, names, OTHERS, "between")
        c.take(4, timeout=30)
        orphan = c.take(4, timeout=30, commit=False)  # recorded, never committed
    total = end_offsets(kafka_config, names.steps)[0]
    assert total == 2 * OTHERS + 3 and reads[0].records == OTHERS  # the first start: no own manifest yet
    reads.clear()
    with consumer(kafka_config, names, group_id) as c:
        again = c.take(4, timeout=30, commit=False)
        assert (again.step, again.group_ids, again.positions) == (2, orphan.group_ids, orphan.positions)
        [start] = reads
        # Three manifests, three records fetched, of 6003 on the topic: two committed ranges, and the tail
        # after the last committed one (where the uncommitted step is).
        assert (len(start.manifests), start.records, start.decoded) == (3, 3, 3)
        c.seek_to_step(0)
        assert reads[1].records == 4 and len(reads[1].manifests) == 4  # the redo's manifest is the 4th
        redo = c.take(4, timeout=30)
        assert redo.step == 1 and not set(redo.group_ids) & set(first.group_ids)
        c.take(4, timeout=30)
        fresh = c.take(4, timeout=30)
        assert fresh.step == 3 and not set(fresh.group_ids) & set(first.group_ids + redo.group_ids + orphan.group_ids)


def test_commits_without_the_index_fall_back_to_reading_everything(kafka_config, namespace_factory, group_id,
                                                                   reads) -> None:
    names = namespace_factory(partitions=2)
    publish_many(kafka_config, names, 30)
    write_others(kafka_config, names, OTHERS, "before")
    with consumer(kafka_config, names, group_id) as c:
        taken = c.take(5, timeout=30).group_ids + c.take(5, timeout=30).group_ids
        offsets = c.position()
    # An older rollstream committed these offsets: same offsets, no metadata.
    old = Consumer(kafka_config.consumer(group_id, {"enable.auto.commit": False}))
    try:
        old.commit(offsets=[TopicPartition(names.rollouts, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        old.close()
    reads.clear()
    with consumer(kafka_config, names, group_id) as c:
        assert c.next_step == 2 and reads[0].records == OTHERS + 2  # everything, as before the index
        later = c.take(5, timeout=30)
        assert later.step == 2 and not set(later.group_ids) & set(taken)  # dedupe rebuilt from the full read
    reads.clear()
    with consumer(kafka_config, names, group_id) as c:
        assert c.next_step == 3 and reads[0].records == 3  # the commit of step 2 carried the index again
