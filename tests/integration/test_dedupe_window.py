"""The trainer's dedupe window against a real broker (`rollstream.consumers._ledger`, `DedupeWindow`).

Pinned here: over a long run the ledger holds a bounded number of taken ids (counted, not measured as RSS),
a duplicate landing within the window's offsets of its original is still skipped, and a restarted consumer
rebuilds the same bounded ledger from the manifests and still skips such a duplicate.
"""

from __future__ import annotations

from rollstream.consumers import DedupeWindow, RolloutConsumer, audit

from tests.records import make_group, publish, publish_many

WINDOW = DedupeWindow(offsets=60, seconds=0)
STEP = 25
BOUND = WINDOW.offsets + STEP  # the steps ending less than `offsets` before the position, on one partition


def consumer(kafka_config, names, group_id: str) -> RolloutConsumer:
    return RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, dedupe_window=WINDOW)


def duplicates(batch) -> list[str]:
    return sorted(d.group_id for d in batch.dispositions if d.kind == "duplicate")


def test_a_long_run_keeps_a_bounded_ledger_and_skips_a_late_duplicate(kafka_config, namespace_factory,
                                                                      group_id) -> None:
    names = namespace_factory(partitions=1)
    groups = publish_many(kafka_config, names, 40 * STEP)
    sizes = []
    with consumer(kafka_config, names, group_id) as c:
        for _ in range(40):
            c.take(STEP, timeout=30)
            sizes.append(c._progress.ledger.remembered)
        assert max(sizes) <= BOUND < len(groups) and sizes[-1] >= WINDOW.offsets
        # A producer killed before committing its prompt regenerates a group taken 40 records ago.
        late = groups[-40]
        publish(kafka_config, names, [make_group(late.prompt_id, producer_id="again"), make_group("fresh1")])
        batch = c.take(1, timeout=30)
        assert batch.group_ids == ["fresh1#0"] and duplicates(batch) == [late.group_id]
        live = c._progress.ledger.remembered
    # After a restart the ledger is rebuilt from the manifests, as bounded, and still knows the late ids.
    late = groups[-STEP]
    publish(kafka_config, names, [make_group(late.prompt_id, producer_id="again"), make_group("fresh2")])
    with consumer(kafka_config, names, group_id) as c:
        assert c.next_step == 41 and c._progress.ledger.remembered == live <= BOUND
        batch = c.take(1, timeout=30)
        assert batch.group_ids == ["fresh2#0"] and duplicates(batch) == [late.group_id]
    assert audit(kafka_config, names.namespace, group_id).ok


def test_a_seek_back_beyond_the_window_remembers_what_it_forgot(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=1)
    publish_many(kafka_config, names, 510)
    publish(kafka_config, names, [make_group("p470", producer_id="again")])  # offset 510: p470 regenerated
    publish_many(kafka_config, names, 490, prefix="q")
    with consumer(kafka_config, names, group_id) as c:
        for _ in range(40):
            c.take(STEP, timeout=30)
        assert not c._progress.ledger.is_taken("p470#0")  # 500 offsets ago: out of the window
        c.seek_to({0: 500})  # a checkpoint of step 19: the window counts from offset 500 again
        assert c._progress.ledger.is_taken("p470#0") and not c._progress.ledger.is_taken("p500#0")
        batch = c.take(20, timeout=30)
        assert duplicates(batch) == ["p470#0"] and batch.group_ids[:10] == [f"p{i}#0" for i in range(500, 510)]
        assert c._progress.ledger.remembered <= BOUND + 20
    assert audit(kafka_config, names.namespace, group_id).ok
