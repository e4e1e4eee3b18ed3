"""verl's fully-async queue on rollstream, against a real broker and the real verl 0.9.1 package (CPU parts).

The rollouter side (`VerlRolloutQueue`) is fed the bytes verl's rollouter puts (``ray.cloudpickle`` of a
RolloutSample, fully_async_rollouter.py:1007) built by the stand-in of verl's agent loop
(tests.standins.verl_fully_async.rollouts.py); the trainer side (`VerlTrainerQueue`) is called as verl's
``_get_samples_from_queue`` calls it (fully_async_trainer.py:403-439), and its output goes through verl's own
``assemble_batch_from_rollout_samples``. Pinned: exactly ``required_samples`` per step; nothing dropped when
"full" (the queue size is the lag); the rollouter stamps the trainer's run; a trainer resumed from an older
checkpoint (a new run) continues exactly after its step and never trains the dead run's groups, also those of
higher param versions and those in the steps the dead run recorded after the checkpoint (filtered, recorded,
audit green), while every group of its own run is trained; a rollouter restarted mid-epoch that reuses its
counter for other prompts loses no group to dedupe; the rollouter's end reaches verl as its end signal; a
replaced trainer cannot commit.
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("verl", reason="the verl extra is not installed (pip install 'rollstream[verl]')")
ray = pytest.importorskip("ray")

from rollstream.consumers import audit  # noqa: E402
from rollstream.consumers._verl_rollouter import VerlRolloutQueue  # noqa: E402
from rollstream.consumers.verl import VerlSettings, VerlTrainerQueue  # noqa: E402
from rollstream.infra.runs import RunSupersededError  # noqa: E402
from rollstream.schemas import LifecycleError  # noqa: E402
from verl.experimental.fully_async_policy.detach_utils import assemble_batch_from_rollout_samples  # noqa: E402

from tests.standins.verl_fully_async.rollouts import rollout_sample  # noqa: E402

N = 4  # rollout.n
STEP = 3  # required_samples = ppo_mini_batch_size * require_batches


def settings(bootstrap: str, names, group: str) -> VerlSettings:
    return VerlSettings(bootstrap_servers=bootstrap, namespace=names.namespace, group=group, take_timeout_s=30.0,
                        poll_interval_s=0.2, lag_refresh_s=0.0, kafka_timeout_s=20.0)


def sample(index: int, *, version: int = 0, counter: int | None = None):
    """The RolloutSample of prompt `index`, named by the rollouter's `counter` (default: `index`)."""
    rs = rollout_sample(index, n=N, version=version)
    if counter is not None:  # a resumed rollouter counts again while its dataloader went on: another prompt
        rs.sample_id = f"sample_0_{counter}"
    return rs


def publish(s: VerlSettings, run: int, samples: list) -> None:
    """A rollouter (a new one each call: a restarted rollouter) serving trainer run `run` puts `samples`."""
    async def go() -> None:
        queue = VerlRolloutQueue(s)
        queue.serve_run(run)
        try:
            for rs in samples:
                assert await queue.put_sample(ray.cloudpickle.dumps(rs)) is True
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


def versions(samples: list) -> set[int]:
    return {int(v) for s in samples for v in s.full_batch.non_tensor_batch["min_global_steps"]}


def test_a_resume_from_an_older_checkpoint_never_trains_the_dead_runs_groups(bootstrap_servers, kafka_config,
                                                                             namespace_factory, group_id,
                                                                             tmp_path) -> None:
    namespace = namespace_factory(partitions=1)  # one partition: the steps' order is the order published
    s = settings(bootstrap_servers, namespace, group_id)
    dead = trainer_queue(s)
    dead_run = dead.announce(0)
    # verl's rollouter finishes samples out of order: 1, 2 and 4 are trained first, 3 is still generating
    publish(s, dead_run, [sample(i) for i in (1, 2, 4, 3, 5, 6)])
    step0 = take_step(dead)
    assert ids(step0) == ["sample_0_1", "sample_0_2", "sample_0_4"]
    batch = assemble_batch_from_rollout_samples(step0, tokenizer=None, config=None)
    assert len(batch) == STEP * N and batch.batch["responses"].shape[0] == STEP * N
    assert dead.commit_trained() == 0
    assert dead.metrics()["rollstream/taken_total"] == STEP
    dead.announce(1)
    dead.save_position(tmp_path / "global_step_1")  # verl's checkpoint of param version 1, after step 0
    assert ids(take_step(dead)) == ["sample_0_3", "sample_0_5", "sample_0_6"]
    dead.commit_trained()
    dead.announce(2)
    publish(s, dead_run, [sample(i, version=2) for i in range(7, 7 + 2 * STEP)])  # versions above the checkpoint's
    assert versions(take_step(dead)) == {2}
    dead.commit_trained()
    dead.announce(3)
    take_step(dead)  # ... and the trainer dies before it trained this one
    dead.close()

    resumed = trainer_queue(s)  # verl restores global_step_1: param version 1, a new trainer run
    assert resumed.resume_from(tmp_path / "global_step_1") == 0
    run = resumed.announce(1)
    assert run > dead_run
    # the restarted rollouter counts again from version x required samples + 1 = 4, its dataloader after prompt 6
    fresh = [sample(100 + i, version=1, counter=4 + i) for i in range(2 * STEP)]
    publish(s, run, fresh)
    taken = []
    filtered = 0
    for _ in range(2):
        step = take_step(resumed)
        filtered += int(resumed.metrics().get("rollstream/filtered_total", 0))
        resumed.commit_trained()
        taken += step
    resumed.close()
    assert sorted(ids(taken)) == sorted(ids(fresh))  # all of its own run's, sample_0_4 included
    assert versions(taken) == {1}
    assert filtered == 2 * STEP + 2 * STEP - 3  # the dead run's groups after the checkpoint, none trained
    report = audit(kafka_config, namespace.namespace, group_id)
    assert report.ok, report.summary()


def test_a_rollouter_restarted_mid_epoch_loses_no_group_to_its_counter(bootstrap_servers, kafka_config,
                                                                         namespace_factory, group_id) -> None:
    namespace = namespace_factory(partitions=1)
    s = settings(bootstrap_servers, namespace, group_id)
    trainer = trainer_queue(s)
    run = trainer.announce(0)
    publish(s, run, [sample(i) for i in range(STEP)])
    first = take_step(trainer)
    trainer.commit_trained()
    again = [sample(50 + i, counter=i) for i in range(STEP)]  # restarted: the same counter values, other prompts
    publish(s, run, again)
    second = take_step(trainer)
    assert trainer.metrics().get("rollstream/duplicate_total", 0) == 0
    trainer.commit_trained()
    trainer.close()
    assert ids(first) == ids(second) == [f"sample_0_{i}" for i in range(STEP)]
    prompts = [int(s.full_batch.non_tensor_batch["index"][0]) for s in second]
    assert prompts == [50 + i for i in range(STEP)]
    report = audit(kafka_config, namespace.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["taken"] == 2 * STEP


def test_backpressure_end_of_stream_and_fencing(bootstrap_servers, namespace, group_id) -> None:
    s = settings(bootstrap_servers, namespace, group_id)

    async def unstamped() -> None:
        queue = VerlRolloutQueue(s)
        try:
            await queue.put_sample(ray.cloudpickle.dumps(sample(0)))
        finally:
            queue.close()

    with pytest.raises(LifecycleError, match="no trainer run"):
        asyncio.run(unstamped())
    old = trainer_queue(s)
    old_run = old.announce(3)
    publish(s, old_run, [sample(i, version=3) for i in range(STEP + 1)])

    async def sizes() -> int:
        queue = VerlRolloutQueue(s)
        try:
            return await queue.get_queue_size()
        finally:
            queue.close()

    assert asyncio.run(sizes()) == STEP + 1  # nothing dropped: the "queue size" is the trainer group's lag
    assert len(take_step(old)) == STEP
    new = trainer_queue(s)
    new_run = new.announce(3)  # a replacement trainer began a new run: the old one may not commit any more
    with pytest.raises(RunSupersededError):
        old.commit_trained()
    old.close()

    async def end() -> None:
        queue = VerlRolloutQueue(s)
        queue.serve_run(new_run)
        try:
            for i in range(10, 10 + STEP):
                await queue.put_sample(ray.cloudpickle.dumps(sample(i, version=3)))
            await queue.put_sample(None)  # the rollouter's end of data
        finally:
            queue.close()

    asyncio.run(end())
    started = time.monotonic()
    assert sorted(ids(take_step(new))) == [f"sample_0_{i}" for i in range(10, 10 + STEP)]  # the old run's: filtered
    assert new.metrics()["rollstream/filtered_total"] >= STEP + 1  # and the end marker, if this step reached it
    new.commit_trained()
    assert take_step(new) == []  # then the end marker: verl's end signal (None)
    assert time.monotonic() - started < 25
    new.close()
