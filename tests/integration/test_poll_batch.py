"""poll_batch(n, timeout) against a real broker: the wait for adapters that serve their trainer in between.

Pinned here: (1) a slice that ends without n groups returns None without raising, within its timeout, commits
nothing, loses nothing (the groups gathered stay buffered, in order) and reads nothing of the cluster (no
diagnosis, no status thread); (2) once the groups are there it returns exactly the batch `take` would, and
commits it with ``commit=True``; (3) `timeout_error` is the TakeTimeout for the caller's own deadline, with
what the last poll looked at and the diagnosis.
"""

from __future__ import annotations

import threading
import time

import pytest
from rollstream.consumers import RolloutConsumer, TakeTimeout
from rollstream.infra import KafkaConfig, LagReader
from rollstream.schemas import RollstreamError

from tests.records import publish_many


def _committed(kafka_config: KafkaConfig, names, group_id: str) -> dict[int, int | None]:
    with LagReader(kafka_config) as reader:
        return {p.partition: p.committed for p in reader.group_lag(group_id, names.rollouts).partitions}


def _status_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rollstream-status")]


def test_poll_batch_returns_none_keeps_what_it_gathered_then_the_exact_batch(kafka_config, namespace_factory,
                                                                            group_id) -> None:
    names = namespace_factory(partitions=1)
    early = publish_many(kafka_config, names, 3, prefix="early")
    before = _status_threads()
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        started = time.monotonic()
        assert c.poll_batch(5, 2.0) is None  # no TakeTimeout
        assert 1.9 <= time.monotonic() - started < 4.5
        assert c.buffered() == 3 and _committed(kafka_config, names, group_id) == {0: None}
        for _ in range(10):  # a loop of short slices: still nothing raised, nothing lost, nothing read
            assert c.poll_batch(5, 0) is None
        assert c.buffered() == 3 and _status_threads() == before
        late = publish_many(kafka_config, names, 2, prefix="late")
        batch = None
        deadline = time.monotonic() + 30
        while batch is None and time.monotonic() < deadline:
            batch = c.poll_batch(5, 0.5)
        assert batch is not None and batch.step == 0
        assert batch.group_ids == [g.group_id for g in early + late]
        assert [d.kind for d in batch.dispositions] == ["taken"] * 5
        assert _committed(kafka_config, names, group_id) == {0: 5}  # commit=True, as take's default
        assert c.poll_batch(1, 0) is None and c.next_step == 1


def test_poll_batch_commit_false_and_timeout_error(kafka_config, namespace_factory, group_id) -> None:
    names = namespace_factory(partitions=2)
    groups = publish_many(kafka_config, names, 2, prefix="g")
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as c:
        batch = None
        deadline = time.monotonic() + 30
        while batch is None and time.monotonic() < deadline:
            batch = c.poll_batch(2, 0.5, commit=False)
        assert batch is not None and sorted(batch.group_ids) == sorted(g.group_id for g in groups)
        assert c.pending() == [batch] and _committed(kafka_config, names, group_id) == {0: None, 1: None}
        c.commit(batch)
        publish_many(kafka_config, names, 1, prefix="more")
        until = time.monotonic() + 30
        while c.poll_batch(3, 0.5) is None and time.monotonic() < until and c.buffered() < 1:
            pass
        assert c.poll_batch(3, 0.5) is None  # one of three: still a wait, not an error
        error = c.timeout_error(3, 4.0)
        assert isinstance(error, TakeTimeout) and (error.wanted, error.gathered, error.timeout) == (3, 1, 4.0)
        assert "take(3) timed out after 4 s with 1 of 3 groups" in str(error)
        assert error.diagnosis.seen == "looked at 1 group: 1 taken"
        with pytest.raises(RollstreamError, match="give a timeout"):
            c.poll_batch(3, None)  # type: ignore[arg-type]
