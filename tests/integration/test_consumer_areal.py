"""rollstream.consumers.areal against a real broker and AReaL 1.0.4's own WorkflowExecutor (generation through its
dispatcher threads; the inference engine, a GPU part, stood in by `Engine`: a version counter). Pins: exactly one
step per prepare_batch, the exact trajectories back, commit only after the step trained (the version moved), the
same batch after a crash before the commit, and a recovered run continuing after the checkpoint's step, its
producers stamping the new run."""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="AReaL is not installed (make install-areal: .venv-areal)")

import torch  # noqa: E402
from areal.api import RolloutWorkflow  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from rollstream.consumers.areal import ArealSettings, RollstreamExecutor  # noqa: E402

BATCH = 2


class Engine:
    """The inference engine's version, all the executor asks of it (AReaL's RemoteInfEngine.get_version)."""

    def __init__(self) -> None:
        self.version = 0

    def get_version(self) -> int:
        return self.version


class Prompts:
    """A dataloader of prompts (AReaL iterates batches of items and reads ``batch_size``)."""

    batch_size = BATCH

    def __iter__(self):
        for i in range(0, 1000, BATCH):
            yield [{"id": i + k} for k in range(BATCH)]


class Toy(RolloutWorkflow):
    """RLVR's trajectory format (areal/workflow/rlvr.py) for prompt `id`, two rows of one prompt."""

    async def arun_episode(self, engine, data):
        i, v = data["id"], engine.get_version()
        ids = torch.tensor([[7, i, 1, 2, 3], [7, i, 4, 0, 0]], dtype=torch.int32)
        attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
        return {"input_ids": ids, "attention_mask": attention,
                "loss_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.int32),
                "logprobs": torch.tensor([[0, 0, -.1, -.2, -.3], [0, 0, -.4, 0, 0]], dtype=torch.float32),
                "versions": torch.tensor([[-1, -1, v, v, v], [-1, -1, v, 0, 0]], dtype=torch.int32),
                "rewards": torch.tensor([float(i), 0.5], dtype=torch.float32)}


def executor(bootstrap_servers: str, names, group: str) -> tuple[RollstreamExecutor, Engine]:
    engine = Engine()
    config = InferenceEngineConfig(consumer_batch_size=BATCH, max_head_offpolicyness=2, max_concurrent_rollouts=4)
    s = ArealSettings(bootstrap_servers=bootstrap_servers, namespace=names.namespace, group=group, take_timeout_s=30,
                      poll_interval_s=0.1, lag_refresh_s=0.0, kafka_timeout_s=20)
    ex = RollstreamExecutor(config, engine, settings=s)
    ex.initialize(train_data_parallel_size=1)
    return ex, engine


def ids(batch: list[dict]) -> list[int]:
    return [int(t["input_ids"][0, 1]) for t in batch]


def run_two_steps(bootstrap_servers: str, namespace, group_id: str) -> list[dict]:
    """Step 0 taken, refused as untrained, trained and committed; step 1 taken and never committed (a crash)."""
    ex, engine = executor(bootstrap_servers, namespace, group_id)
    try:
        first = ex.prepare_batch(Prompts(), Toy())
        assert len(first) == BATCH  # exactly one step's worth
        t = first[0]
        assert t["input_ids"].dtype == torch.int32 and t["attention_mask"].dtype == torch.bool
        assert t["rewards"].shape == (2,)
        assert torch.equal(t["versions"][0], torch.tensor([-1, -1, 0, 0, 0], dtype=torch.int32))
        ex.resume()  # not trained (version still 0): nothing committed
        with pytest.raises(Exception, match="not trained"):
            ex.prepare_batch(Prompts(), Toy())
        engine.version = 1  # AReaL's set_version after ppo_update
        assert ex.commit_trained(only_if_trained=True) == 0  # the step trained: committed
        second = ex.prepare_batch(Prompts(), Toy())  # step 1, taken at version 1, never committed: a crash
        assert [b.step for b in ex.consumer.pending()] == [1]
        return second
    finally:
        ex.destroy()


def test_steps_commit_after_training_and_recover(bootstrap_servers: str, namespace, group_id: str) -> None:
    run_two_steps(bootstrap_servers, namespace, group_id)
    ex3, engine3 = executor(bootstrap_servers, namespace, group_id)
    try:
        engine3.version = 1  # AReaL recovered the checkpoint of global step 0
        assert ex3.recover(1) == 0  # continue exactly after the step taken at version 0
        again = ex3.prepare_batch(Prompts(), Toy())
        assert len(again) == BATCH and [b.step for b in ex3.consumer.pending()] == [1]  # right after step 0
        assert all(int(t["versions"][0, 2]) <= 1 for t in again)
        assert ex3.publisher.policy_run >= 2  # producers stamp the resumed run
    finally:
        ex3.destroy()


@pytest.mark.xfail(strict=True, reason="open: a restarted trainer is a new trainer run, and the stale filter drops "
                   "the dead run's groups (older run), so the uncommitted step is judged afresh, not handed back")
def test_crash_before_commit_gives_the_same_batch(bootstrap_servers: str, namespace, group_id: str) -> None:
    second = run_two_steps(bootstrap_servers, namespace, group_id)
    ex2, engine2 = executor(bootstrap_servers, namespace, group_id)
    try:
        engine2.version = 1
        again = ex2.prepare_batch(Prompts(), Toy())
        assert ids(again) == ids(second)
        for a, b in zip(again, second, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b)
    finally:
        ex2.destroy()
