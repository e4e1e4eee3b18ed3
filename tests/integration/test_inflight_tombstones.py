"""Which keys of NS.inflight a published group tombstones, against the session's broker.

Only those with a checkpoint: the samples this producer saved and those it found from another producer. A
group whose samples all finished within their first interval (the usual case) writes nothing to NS.inflight,
not a tombstone per sample (at a fleet's rate that was thousands of records a second, for nothing).
"""

from __future__ import annotations

import asyncio

from rollstream.infra import KafkaConfig, KafkaIOError, TopicNames
from rollstream.infra.deadline import Deadline
from rollstream.producers._inflight import Checkpoints, open_checkpoints
from rollstream.producers._threads import ProducerThreads
from rollstream.producers.engines.progress import SampleState
from rollstream.producers.intake import TakenPrompt
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import Prompt

from tests.integration._inflight import newest_checkpoints


async def _publish_two_groups(kafka_config: KafkaConfig, names: TopicNames, *, unreadable: bool = False
                              ) -> tuple[str, str]:
    """Group A saves nothing; group B saves sample 1 twice; both are then published. Their group ids.
    `unreadable`: reading the partition's checkpoints fails (as it does against a broker that does not answer)."""
    threads = ProducerThreads(1)
    inflight = await open_checkpoints(
        kafka_config, names.inflight, prompts_topic=names.prompts, intake_group=f"{names.namespace}.producers",
        producer_id="P1", max_staleness=None, interval_s=30.0, metrics=ProducerMetrics(), threads=threads,
        loop=asyncio.get_running_loop(), timeout=30.0)
    assert inflight is not None
    if unreadable:
        async def fail(prompt_partition: int) -> Checkpoints:
            raise KafkaIOError(f"cannot read {names.inflight}[{prompt_partition}]", retriable=True)
        inflight._read = fail  # type: ignore[method-assign]  # noqa: SLF001
    try:
        quick, slow = (TakenPrompt(0, offset, 0, Prompt(id=f"p{offset}", prompt="q"), None, 0) for offset in (0, 1))
        for taken in (quick, slow):
            progress = await inflight.progress_for(taken, policy_run=0, version=0)
            assert progress is not None
            if taken is slow:
                progress.save(1, SampleState(tokens=[1, 2], logprobs=[-0.1, -0.2]))
                progress.save(1, SampleState(tokens=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3]))
                await inflight.writer.settle(Deadline.after(30.0))  # written before the group is published
            inflight.published(taken, 2)
        await inflight.close(Deadline.after(30.0))
    finally:
        threads.close()
    assert quick.prompt is not None and slow.prompt is not None
    return quick.prompt.group_id, slow.prompt.group_id


def test_a_published_group_tombstones_only_the_samples_that_had_a_checkpoint(
        kafka_config: KafkaConfig, namespace_factory) -> None:
    names = namespace_factory(partitions=1)
    quick, slow = asyncio.run(_publish_two_groups(kafka_config, names))
    checkpointed: set[str] = set()
    newest = newest_checkpoints(kafka_config, names.inflight, checkpointed=checkpointed)
    assert checkpointed == {f"{slow}/1"}
    assert newest == {f"{slow}/1": None}  # its checkpoint, then its tombstone; nothing of `quick`'s


def test_a_group_whose_partition_was_unreadable_tombstones_every_sample(
        kafka_config: KafkaConfig, namespace_factory) -> None:
    """Which samples another producer checkpointed is then unknown: all of them get a tombstone, as before."""
    names = namespace_factory(partitions=1)
    quick, slow = asyncio.run(_publish_two_groups(kafka_config, names, unreadable=True))
    newest = newest_checkpoints(kafka_config, names.inflight)
    assert newest == {f"{g}/{i}": None for g in (quick, slow) for i in (0, 1)}
