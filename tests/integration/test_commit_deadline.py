"""`RolloutConsumer.commit` keeps its deadline against a frozen broker, and commits a step whole or not at all.

Pinned here, against the session's freezable broker (`freezable_broker`; the main one must not freeze), for a
broker frozen before the commit began and one frozen between the offsets check and the commit itself (so that
the asynchronous commit is what waits): `commit` returns or raises a `RollstreamError` within the consumer's
timeout plus `GRACE_S`, and `close` right after keeps its own bound (`CLOSE_S` plus `GRACE_S`), no crash. Once
the broker resumes, the group stands either after the step (a commit that got no answer may still land) or
before it, never half: the next consumer's first take is then the next step, or the same batch again.
"""

from __future__ import annotations

import signal
import time

import pytest
from rollstream.consumers import Batch, RolloutConsumer
from rollstream.consumers._consumer import CLOSE_S
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.deadline import GRACE_S, Deadline
from rollstream.infra.kafka_io import committed_offsets, reader
from rollstream.schemas import RollstreamError

from tests.integration._kafka import signal_all
from tests.records import publish_many

TIMEOUT_S = 4.0  # the consumer's timeout: what one commit may take
FROZEN_S = 7.0  # shorter than the broker session (9 s): the broker does not fence itself on SIGCONT
N = 3


def _group_offsets(config: KafkaConfig, names: TopicNames, group: str) -> dict[int, int]:
    """The group's committed offsets (0 where it committed nothing: where the partition starts)."""
    with reader(config, group) as consumer:
        found = committed_offsets(consumer, names.rollouts, [0, 1], timeout=20)
    return {p: o or 0 for p, o in found.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen", ["before", "during"])
def test_a_commit_against_a_frozen_broker_keeps_its_deadline_and_commits_whole_or_not(
        freezable_broker: tuple[KafkaConfig, tuple[int, ...]], frozen: str) -> None:
    config, pids = freezable_broker
    names, group = TopicNames(f"freeze-{frozen}"), f"freeze-{frozen}"
    create_topics(TopicPlan(names=names, partitions=2), config)
    publish_many(config, names, 3 * N)
    consumer = RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=(),
                               timeout=TIMEOUT_S)
    try:
        first = consumer.take(N, timeout=30)  # committed: the group stands after step 0
        batch = consumer.take(N, timeout=30, commit=False)
        if frozen == "before":
            signal_all(pids, signal.SIGSTOP)
        else:  # frozen once the offsets check passed: the asynchronous commit itself gets no answer
            check = consumer._committer._check_sole_committer

            def check_then_freeze(b: Batch | None, deadline: Deadline) -> None:
                check(b, deadline)
                signal_all(pids, signal.SIGSTOP)
            consumer._committer._check_sole_committer = check_then_freeze  # type: ignore[method-assign]
        frozen_at = started = time.monotonic()
        try:
            consumer.commit(batch)
            outcome = "committed"
        except RollstreamError as exc:
            outcome = str(exc)
        took = time.monotonic() - started
        assert took <= TIMEOUT_S + GRACE_S, (took, outcome)
    finally:
        started = time.monotonic()
        consumer.close()  # right away, the broker still frozen
        closing = time.monotonic() - started
        time.sleep(max(0.0, FROZEN_S - (time.monotonic() - frozen_at)))
        signal_all(pids, signal.SIGCONT)
    print(f"\nMEASURE {frozen}: commit {took:.2f} s ({outcome[:150]}); close {closing:.2f} s")
    assert closing <= CLOSE_S + GRACE_S, closing
    assert outcome == "committed" or "still uncommitted" in outcome, outcome
    offsets = _group_offsets(config, names, group)
    assert offsets in (dict(first.offsets), dict(batch.offsets)), (offsets, first.offsets, batch.offsets)
    with RolloutConsumer(config=config, group_id=group, namespace=names.namespace, filters=(),
                         timeout=20) as again:
        following = again.take(N, timeout=30)
    if offsets == dict(batch.offsets):  # the step landed (an unanswered commit may still): the next step follows
        assert following.step == batch.step + 1 and not set(following.group_ids) & set(batch.group_ids)
    else:  # it did not: the same batch again, whole
        assert (following.step, following.group_ids) == (batch.step, batch.group_ids)
