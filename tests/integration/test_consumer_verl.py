"""verl's fully-async queue on rollstream, against a real broker and the real verl 0.9.1 package (CPU parts).

The rollouter side (`VerlRolloutQueue`) is fed the bytes verl's rollouter puts (``ray.cloudpickle`` of a
RolloutSample, fully_async_rollouter.py:1007) built by the stand-in of verl's agent loop
(tests.standins.verl_fully_async.rollouts.py); the trainer side (`VerlTrainerQueue`) is called as verl's
``_get_samples_from_queue`` calls it (fully_async_trainer.py:403-439), and its output goes through verl's own
``assemble_batch_from_rollout_samples``. Pinned: exactly ``required_samples`` per step; nothing dropped when
"full" (the queue size is the lag); a crash before commit gives the same batch back; a checkpoint of step k
resumes exactly after k; the rollouter's end reaches verl as its end signal; a replaced trainer cannot commit.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")
ray = pytest.importorskip("ray")

from rollstream.consumers._verl_rollouter import VerlRolloutQueue  # noqa: E402
from rollstream.consumers.verl import VerlSettings, VerlTrainerQueue  # noqa: E402
from rollstream.infra.runs import RunSupersededError  # noqa: E402
from verl.experimental.fully_async_policy.detach_utils import assemble_batch_from_rollout_samples  # noqa: E402

from tests.standins.verl_fully_async.rollouts import rollout_sample  # noqa: E402

N = 4  # rollout.n
STEP = 3  # required_samples = ppo_mini_batch_size * require_batches


def settings(bootstrap: str, names, group: str) -> VerlSettings:
    return VerlSettings(bootstrap_servers=bootstrap, namespace=names.namespace, group=group, take_timeout_s=30.0,
                        poll_interval_s=0.2, lag_refresh_s=0.0, kafka_timeout_s=20.0)


def publish(s: VerlSettings, first: int, count: int) -> None:
    async def go() -> None:
        queue = VerlRolloutQueue(s)
        try:
            for i in range(first, first + count):
                assert await queue.put_sample(ray.cloudpickle.dumps(rollout_sample(i, n=N, version=0))) is True
        finally:
            queue.close()

    asyncio.run(go())


def take_step(trainer: VerlTrainerQueue) -> list:
    """What verl's _get_samples_from_queue does: get_sample until required_samples, unpickle, assemble."""
    async def go() -> list:
        out = []
        while len(out) < STEP:
            sample, _left = await trainer.get_sample()
            if sample is None:
                break
            out.append(ray.cloudpickle.loads(sample))
        return out

    return asyncio.run(go())


def trainer_queue(s: VerlSettings) -> VerlTrainerQueue:
    return VerlTrainerQueue(s, groups_per_step=STEP, group_size=N)


def ids(samples: list) -> list[str]:
    return [s.sample_id for s in samples]


def test_steps_crash_and_checkpoint_resume(bootstrap_servers, namespace, group_id, tmp_path) -> None:
    s = settings(bootstrap_servers, namespace, group_id)
    publish(s, 0, 4 * STEP)

    first = trainer_queue(s)
    first.announce(0)
    step0 = take_step(first)
    assert len(step0) == STEP
    batch = assemble_batch_from_rollout_samples(step0, tokenizer=None, config=None)
    assert len(batch) == STEP * N and batch.batch["responses"].shape[0] == STEP * N
    assert first.commit_trained() == 0
    assert first.metrics()["rollstream/taken_total"] == STEP
    first.save_position(tmp_path / "global_step_1")  # verl's checkpoint of param version 1, after step 0
    step1 = take_step(first)
    first.close()  # the trainer died before it trained step 1: nothing committed

    again = trainer_queue(s)
    assert ids(take_step(again)) == ids(step1)  # the same batch, same order
    again.commit_trained()
    take_step(again)
    again.commit_trained()  # steps 1 and 2 committed
    again.close()

    resumed = trainer_queue(s)  # verl restores global_step_1: rollstream continues exactly after step 0
    assert resumed.resume_from(tmp_path / "global_step_1") == 0
    assert ids(take_step(resumed)) == ids(step1)
    resumed.close()


def test_backpressure_end_of_stream_and_fencing(bootstrap_servers, namespace, group_id) -> None:
    s = settings(bootstrap_servers, namespace, group_id)
    publish(s, 0, STEP + 1)

    async def sizes() -> int:
        queue = VerlRolloutQueue(s)
        try:
            return await queue.get_queue_size()
        finally:
            queue.close()

    assert asyncio.run(sizes()) == STEP + 1  # nothing dropped: the "queue size" is the trainer group's lag
    old = trainer_queue(s)
    old.announce(3)
    assert len(take_step(old)) == STEP
    new = trainer_queue(s)
    new.announce(3)  # a replacement trainer began a new run: the old one may not commit any more
    with pytest.raises(RunSupersededError):
        old.commit_trained()
    old.close()

    async def end() -> None:
        queue = VerlRolloutQueue(s)
        try:
            await queue.put_sample(None)  # the rollouter's end of data
        finally:
            queue.close()

    asyncio.run(end())
    started = time.monotonic()
    assert len(take_step(new)) == STEP  # the step the old run could not commit
    new.commit_trained()
    assert take_step(new) == []  # one group left, then the end marker: verl's end signal (None)
    assert time.monotonic() - started < 25
    new.close()
