"""rollstream.consumers.areal against a real broker and AReaL 1.0.4's own WorkflowExecutor (generation through its
dispatcher threads; the inference engine, a GPU part, stood in by `Engine`: a version counter). Pins: exactly one
step per prepare_batch, the exact trajectories back, commit only after the step trained (the version moved), the
same batch after a crash before the commit (AReaL recovering the checkpoint the dead run had), a run recovered from
an earlier checkpoint continuing right after its step with nothing of the dead run's lost weights trained and the
audit green, and producers stamping the new run."""

from __future__ import annotations

import pytest

pytest.importorskip("areal", reason="AReaL is not installed (make install-areal: .venv-areal)")

import torch  # noqa: E402
from areal.api import RolloutWorkflow  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig  # noqa: E402
from rollstream.consumers import audit  # noqa: E402
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


def same(a: list[dict], b: list[dict]) -> bool:
    return ids(a) == ids(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in y)


def handed(ex: RollstreamExecutor) -> tuple[int, list[str]]:
    """The step handed over and not committed: its number and its groups' ids, in order."""
    (batch,) = ex.consumer.pending()
    return batch.step, [g.group_id for g in batch.groups]


def run_steps(bootstrap_servers: str, names, group_id: str, trained: int) -> tuple[list, int]:
    """Steps 0..trained-1 taken and trained (committed); step `trained` taken and never committed (a crash). Step 0
    is first refused as untrained. Returns each step's trajectories and group ids, and the run's number."""
    ex, engine = executor(bootstrap_servers, names, group_id)
    steps = []
    try:
        for k in range(trained + 1):
            batch = ex.prepare_batch(Prompts(), Toy())
            step, group_ids = handed(ex)
            assert len(batch) == BATCH and step == k  # exactly one step's worth
            steps.append((batch, group_ids))
            if k == 0:
                t = batch[0]
                assert t["input_ids"].dtype == torch.int32 and t["attention_mask"].dtype == torch.bool
                assert t["rewards"].shape == (2,)
                assert torch.equal(t["versions"][0], torch.tensor([-1, -1, 0, 0, 0], dtype=torch.int32))
                ex.resume()  # not trained (version still 0): nothing committed
                with pytest.raises(Exception, match="not trained"):
                    ex.prepare_batch(Prompts(), Toy())
            if k < trained:
                engine.version = k + 1  # AReaL's set_version after ppo_update
                assert ex.commit_trained(only_if_trained=True) == k  # the step trained: committed
        return steps, ex.publisher.policy_run
    finally:
        ex.destroy()


def recovered(bootstrap_servers: str, names, group_id: str, version: int) -> tuple[RollstreamExecutor, Engine]:
    """A restarted trainer as AReaL recovers it: the checkpoint of global step ``version - 1`` loaded, the engine set
    to `version`, then ``staleness_manager.on_version_recovered(version)`` (areal/trainer/rl_trainer.py)."""
    ex, engine = executor(bootstrap_servers, names, group_id)
    engine.version = version
    ex.staleness_manager.on_version_recovered(version)
    return ex, engine


def test_crash_before_commit_gives_the_same_batch(bootstrap_servers: str, namespace, group_id: str) -> None:
    steps, dead_run = run_steps(bootstrap_servers, namespace, group_id, trained=1)
    ex2, engine2 = recovered(bootstrap_servers, namespace, group_id, 1)  # the checkpoint of global step 0
    try:
        again = ex2.prepare_batch(Prompts(), Toy())
        assert same(again, steps[1][0]) and handed(ex2) == (1, steps[1][1])  # step 1, as recorded
        assert ex2.publisher.policy_run > dead_run  # a new trainer run: producers stamp it
        engine2.version = 2
        assert ex2.commit_trained(only_if_trained=True) == 1
    finally:
        ex2.destroy()


def test_resume_from_a_checkpoint_continues_after_its_step(bootstrap_servers: str, kafka_config, namespace,
                                                           group_id: str) -> None:
    """Steps 0 and 1 trained and committed, step 2 taken; recovered from the checkpoint of global step 0 (version 1):
    step 1 comes back as recorded (its versions are the checkpoint's), then step 2 holds nothing generated by the
    dead run's lost weights (its version 2), and the audit is green."""
    steps, dead_run = run_steps(bootstrap_servers, namespace, group_id, trained=2)
    ex, engine = recovered(bootstrap_servers, namespace, group_id, 1)
    try:
        assert [b.step for b in ex.consumer.pending()] == []
        again = ex.prepare_batch(Prompts(), Toy())
        assert same(again, steps[1][0]) and handed(ex) == (1, steps[1][1])
        engine.version = 2
        ex.prepare_batch(Prompts(), Toy())  # commits step 1, takes step 2
        (step2,) = ex.consumer.pending()
        assert step2.step == 2
        for g in step2.groups:
            newest = max(v for s in g.samples for v in s.weight_versions)
            assert g.policy_run == ex.publisher.policy_run or (g.policy_run == dead_run and newest <= 1), g
        engine.version = 3
        assert ex.commit_trained(only_if_trained=True) == 2
    finally:
        ex.destroy()
    report = audit(kafka_config, namespace.namespace, group_id)
    assert report.ok, report
