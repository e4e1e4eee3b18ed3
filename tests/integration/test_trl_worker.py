"""rollstream as TRL's `AsyncGRPOTrainer` rollout worker (`rollstream.consumers.trl`), against a real broker and
TRL 1.16.

Pinned here: a real AsyncGRPOTrainer trains on CPU from groups a real HF producer published, one step's
groups per optimizer step, committed only after that step; a trainer killed after a step's optimizer step
and before its commit gives that step's groups (same ids, same order) to the next consumer of the group;
each restarted worker begins a new run that the producers follow (down to its versions), and supersedes the
old worker still running (whose commit and health check raise `RunSupersededError`); the samples are what
TRL's own worker builds (async_rollout_worker.py); configs rollstream cannot serve are refused; the worker
thread's error reaches the trainer through `check_health`.
CPU stand-ins for TRL's FlashAttention-3 kernel and GPU probe: see `tests/integration/_trl_train.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("trl.experimental.async_grpo")

from rollstream.consumers import RolloutConsumer, TakeTimeout, audit, grpo_advantages, replay_step  # noqa: E402
from rollstream.consumers.trl import (  # noqa: E402
    RollstreamRolloutWorker,
    TRLWorkerSettings,
    step_shape,
    to_rollout_samples,
    trl_group_id,
)
from rollstream.infra import LagReader, RunSupersededError
from rollstream.infra.control import ControlWatcher
from rollstream.infra.runs import followed_policy  # noqa: E402
from rollstream.producers import HFEngine, ProducerSettings, RolloutProducer, build_tiny_model  # noqa: E402
from rollstream.schemas import (  # noqa: E402
    ConfigError,
    LifecycleError,
    PolicyVersion,
    Sample,
    ScoredGroup,
    make_group_id,
)

from tests.integration._kafka import cli_env, read_records, until, write_prompts  # noqa: E402
from tests.integration._trl_train import EVENT, REPO_ROOT, build_trainer, patch_trl_for_cpu, trl_config  # noqa: E402
from tests.records import make_group, publish  # noqa: E402


def _varied_reward(prompt: dict, completion: dict) -> float:
    """Gibberish from a random model, scored so that a group's rewards differ (non-zero advantages)."""
    return float(sum(completion["tokens"]) % 5)


def _twelve_groups(kafka_config, names, group_id: str, tmp_path) -> Path:
    """12 groups of 4 samples the tiny model generated (HF engine), on NS.rollouts; returns the model's directory."""
    model_dir = build_tiny_model(tmp_path / "tiny")
    write_prompts(kafka_config, names, [f"q{i}" for i in range(12)])
    produced = RolloutProducer(HFEngine(model_dir), ProducerSettings(
        namespace=names.namespace, n_samples=4, concurrency=4, max_lag=1000, max_new_tokens=6, trainer_group=group_id,
        exit_when_idle_s=0.5, summary_interval_s=0), kafka=kafka_config, reward=_varied_reward).run_sync(
        handle_signals=False)
    assert produced.groups_ok == 12
    return model_dir


def test_async_grpo_trainer_trains_from_rollstream(kafka_config, namespace_factory, group_id, tmp_path,
                                                   monkeypatch) -> None:
    names = namespace_factory(partitions=2)
    model_dir = _twelve_groups(kafka_config, names, group_id, tmp_path)

    patch_trl_for_cpu(monkeypatch.setattr)
    args = trl_config(tmp_path / "out", max_steps=3)
    worker = RollstreamRolloutWorker(args, TRLWorkerSettings(
        namespace=names.namespace, group=group_id, take_timeout_s=60, dynamic_sampling=False), kafka=kafka_config)
    assert worker.shape.groups_per_step == 2  # 4 per device x 2 accumulation x 1 process / 4 generations
    trainer = build_trainer(model_dir, args, worker)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()

    assert trainer.state.global_step == 3
    assert any(not p.detach().equal(before[n]) for n, p in trainer.model.named_parameters())
    first = trainer.state.log_history[0]
    # Step 1 trains on samples the same weights generated: TRL's ratio is 1 only if every old_log_prob sits at
    # the position of the token it scores (a shift by one gives ratios far from 1).
    assert abs(first["ratio"] - 1.0) < 1e-4 and abs(first["kl"]) < 1e-6, first
    assert any("rollstream/lag" in entry for entry in trainer.state.log_history)  # metrics_queue reached TRL's logs

    # Exactly steps 0..2 committed (6 of the 12 groups); what was handed ahead is taken again by the next run.
    with LagReader(kafka_config) as reader:
        assert sum(p.committed or 0 for p in reader.group_lag(group_id, names.rollouts).partitions) == 6
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.steps == (0, 1, 2) and report.counts["taken"] == 6
    committed = [g.group_id for k in range(3) for g in replay_step(kafka_config, names.namespace, group_id, k).groups]
    ahead = [g.group_id for g in replay_step(kafka_config, names.namespace, group_id, 3).groups]
    trained = trainer._trained_groups  # TRL's collator: the int group_id of every sample it packed
    assert {trl_group_id(g) for g in committed} <= trained <= {trl_group_id(g) for g in committed + ahead}
    # One announcement per TRL weight sync (the cold one, then after each step), in order.
    versions = [v.version for _, _, v in read_records(kafka_config, names.control, PolicyVersion, key=b"policy")]
    assert versions == [1, 2, 3, 4]


def test_a_trl_run_restarted_twice_leads_the_producers_each_time(kafka_config, namespace_factory, group_id,
                                                                  tmp_path, monkeypatch) -> None:
    names = namespace_factory(partitions=2)
    model_dir = _twelve_groups(kafka_config, names, group_id, tmp_path)
    followed: list[PolicyVersion] = []
    watcher = ControlWatcher(kafka_config, names.control, on_version=followed.append)  # what a producer follows
    watcher.start()
    patch_trl_for_cpu(monkeypatch.setattr)
    try:
        for run in range(3):  # TRL counts its versions from 1 again in every run
            args = trl_config(tmp_path / f"out{run}", max_steps=1)
            worker = RollstreamRolloutWorker(args, TRLWorkerSettings(
                namespace=names.namespace, group=group_id, take_timeout_s=60, dynamic_sampling=False),
                kafka=kafka_config)
            build_trainer(model_dir, args, worker).train()
            until(lambda run=run: len(followed) == 2 * (run + 1), 30, f"the producers to follow run {run + 1}")
    finally:
        watcher.stop()
    assert [(v.run, v.version) for v in followed] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    now = followed_policy(kafka_config, names.control, timeout=10)
    assert (now.policy.run, now.policy.version, now.superseded) == (3, 2, 0)  # type: ignore[union-attr]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["taken"] == 6  # one committed step of 2 groups per run; what was handed ahead came back


def test_a_restarted_trl_worker_supersedes_the_one_still_running(kafka_config, namespace_factory, group_id,
                                                                  tmp_path) -> None:
    """Driven through TRL's worker protocol (no trainer): the node of the old job hangs on while the job restarts."""
    names = namespace_factory(partitions=1)
    publish(kafka_config, names, [make_group(f"g{i}", rewards=(0.0, 1.0, 0.0, 1.0)) for i in range(6)])
    settings = TRLWorkerSettings(namespace=names.namespace, group=group_id, take_timeout_s=30, poll_interval_s=0.2)
    old = RollstreamRolloutWorker(trl_config(tmp_path / "old"), settings, kafka=kafka_config)
    new = RollstreamRolloutWorker(trl_config(tmp_path / "new"), settings, kafka=kafka_config)
    try:
        old.start()
        old.update_model_version(1)  # TRL's cold weight sync: the old run begins
        first = [old.rollout_buffer.get(timeout=30).group_id for _ in range(8)]  # TRL reads step 1 and trains it
        old_run = until(lambda: followed_policy(kafka_config, names.control, timeout=10).policy, 30, "run 1").run
        new.start()
        new.update_model_version(1)  # the restarted job's cold sync: a new run, producers follow it
        again = [new.rollout_buffer.get(timeout=30).group_id for _ in range(8)]
        until(lambda: followed_policy(kafka_config, names.control, timeout=10).policy.run == old_run + 1, 30,
              "the producers to follow the restarted worker's run")
        with pytest.raises(RunSupersededError, match=f"committing step 0 .* trainer run {old_run} "):
            old.commit_step(1)  # the old node comes back and commits what it trained: refused by the broker
        with pytest.raises(RunSupersededError):
            old.check_health(60.0)  # and TRL's health check stops its trainer
        assert again == first and new.commit_step(1) == 0  # the new run trains and commits the same step
    finally:
        old.stop()
        new.stop()
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.steps == (0,) and report.counts["taken"] == 2


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _groups(model_dir, count: int) -> list[ScoredGroup]:
    """Groups of 4 samples with real token ids of the tiny tokenizer (a sum, and four answers)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for i in range(count):
        prompt = _tokens(tokenizer, f"<|im_start|>user\n{i}+2=?<|im_end|>\n<|im_start|>assistant\n")
        answers = [_tokens(tokenizer, f"{i + 2 + s}<|im_end|>") for s in range(4)]
        samples = [Sample(tokens=a, text=str(i + 2 + s), logprobs=[-1.0 - 0.1 * t for t in range(len(a))],
                          reward=float(s == 0)) for s, a in enumerate(answers)]
        out.append(ScoredGroup(group_id=make_group_id(f"sum{i}", 0), prompt_id=f"sum{i}", epoch=0, prompt_tokens=prompt,
                               samples=samples, started_at_ms=1, finished_at_ms=2, prompt=f"{i}+2=?"))
    return out


def test_killed_before_commit_the_step_comes_back(kafka_config, bootstrap_servers, namespace_factory, group_id,
                                                  tmp_path) -> None:
    names = namespace_factory(partitions=1)
    model_dir = build_tiny_model(tmp_path / "tiny")
    good = _groups(model_dir, 8)
    wrong_size = ScoredGroup(group_id="three#0", prompt_id="three", epoch=0, prompt_tokens=good[0].prompt_tokens,
                             samples=list(good[0].samples)[:3], started_at_ms=1, finished_at_ms=2)
    publish(kafka_config, names, [*good[:2], wrong_size, *good[2:]])
    spec = {"bootstrap": bootstrap_servers, "namespace": names.namespace, "group": group_id,
            "model_dir": str(model_dir), "out_dir": str(tmp_path / "out"), "max_steps": 3, "kill_at_step": 2}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "tests/integration/_trl_train.py"), json.dumps(spec)],
                         cwd=REPO_ROOT, env=cli_env(bootstrap_servers, TRL_EXPERIMENTAL_SILENCE="1"),
                         capture_output=True, text=True, timeout=120)
    events = [json.loads(line.removeprefix(EVENT)) for line in run.stdout.splitlines() if line.startswith(EVENT)]
    assert run.returncode == -9, run.stderr[-3000:]
    assert events == [{"trained": 1, "killing": False}, {"trained": 2, "killing": True}]
    with LagReader(kafka_config) as reader:  # TRL step 1 (rollstream step 0) committed, step 2 not
        assert reader.group_lag(group_id, names.rollouts).partitions[0].committed == 2

    # Rollstream step 1 skipped the wrong-size group (recorded) and took the next two; step 2 was handed ahead.
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace) as consumer:
        again = consumer.take(2, timeout=30, commit=False)
        ahead = consumer.take(2, timeout=30, commit=False)
        consumer.commit(ahead)
    assert (again.step, again.group_ids) == (1, [g.group_id for g in good[2:4]])
    assert (ahead.step, ahead.group_ids) == (2, [g.group_id for g in good[4:6]])
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.steps == (0, 1, 2) and report.counts["filtered"] == 1


def test_rollout_samples_are_what_trls_worker_builds(tmp_path) -> None:
    from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences
    from trl.experimental.async_grpo.packing import TreeRow

    group = ScoredGroup(group_id="p7#1", prompt_id="p7", epoch=1, prompt_tokens=[5, 6, 7], started_at_ms=1,
                        finished_at_ms=2, prompt="q", samples=[
                            Sample(tokens=[8, 9], logprobs=[-0.5, -0.25], reward=1.0, weight_versions=(3, 4)),
                            Sample(tokens=[10, 11, 12], logprobs=[-1.0, -2.0, -3.0], reward=0.0, weight_versions=(4,))])
    samples = to_rollout_samples(group, model_version=3)
    assert [s.advantage for s in samples] == pytest.approx(grpo_advantages([1.0, 0.0]))
    for s, src in zip(samples, group.samples, strict=True):
        # TRL's own single-turn reconciliation (async_rollout_worker.py:167-194) of the same tokens.
        (expected,), _ = _chain_to_sequences([TurnRecord([5, 6, 7], src.tokens.tolist(), src.logprobs.tolist())],
                                             "r", 10)
        assert s.input_ids.tolist() == expected.input_ids and s.input_ids.dtype == np.int64
        assert s.completion_mask.tolist() == expected.completion_mask
        assert s.old_log_probs.tolist() == pytest.approx(expected.old_log_probs) and s.old_log_probs.dtype == np.float32
        assert s.model_version == 3 and s.group_id == trl_group_id("p7#1") == trl_group_id("p7#1")
        assert s.metrics == {"reward": src.reward, "reward_std": 0.5}
        # How TRL's packer reads them (packing.py:131-138): each response token is a target with its own logprob.
        row = TreeRow()
        row.add({"input_ids": s.input_ids, "completion_mask": s.completion_mask, "old_log_probs": s.old_log_probs,
                 "advantage": s.advantage, "group_id": s.group_id})
        packed = row.pack()
        assert packed["shift_labels"][packed["token_index"]].tolist() == src.tokens.tolist()
        assert packed["old_log_probs"].tolist() == pytest.approx(src.logprobs.tolist())
    assert 0 <= trl_group_id("p7#1") < 2**63 and trl_group_id("p7#1") != trl_group_id("p7#2")


def test_configs_rollstream_cannot_serve_are_refused(tmp_path) -> None:
    settings = TRLWorkerSettings()
    shape = step_shape(trl_config(tmp_path, gradient_accumulation_steps=3, num_generations=6), settings)
    assert (shape.samples_per_step, shape.groups_per_step, shape.max_staleness) == (12, 2, 2)  # TRL's 4 - prefetch 2
    with pytest.raises(ConfigError, match="token_budget=0"):
        step_shape(trl_config(tmp_path, token_budget=None), settings)
    with pytest.raises(ConfigError, match="not a multiple of num_generations=3"):
        step_shape(trl_config(tmp_path, num_generations=3), settings)
    with pytest.raises(ConfigError, match="must be <= 1"):
        step_shape(trl_config(tmp_path, max_staleness=3), TRLWorkerSettings(max_staleness=2))
    with pytest.raises(ConfigError, match="prefetch_steps=1"):
        TRLWorkerSettings(prefetch_steps=1)


def test_a_worker_built_for_another_step_shape_is_refused(tmp_path, monkeypatch) -> None:
    patch_trl_for_cpu(monkeypatch.setattr)
    model_dir = build_tiny_model(tmp_path / "tiny")
    worker = RollstreamRolloutWorker(trl_config(tmp_path / "a", gradient_accumulation_steps=1), TRLWorkerSettings())
    trainer = build_trainer(model_dir, trl_config(tmp_path / "b"), worker)  # 8 samples a step, not 4
    with pytest.raises(ConfigError, match="build RollstreamRolloutWorker with the trainer's args"):
        trainer.train()
    assert not worker.started  # refused before TRL started it: nothing taken


def test_check_health_raises_the_worker_threads_error(kafka_config, namespace_factory, group_id, tmp_path) -> None:
    names = namespace_factory(partitions=1)
    worker = RollstreamRolloutWorker(trl_config(tmp_path), TRLWorkerSettings(
        namespace=names.namespace, group=group_id, take_timeout_s=1.0, poll_interval_s=0.2), kafka=kafka_config)
    with pytest.raises(LifecycleError, match="not running"):
        worker.check_health(60.0)
    worker.start()
    try:
        worker.check_health(60.0)  # running, nothing published yet: healthy
        deadline = time.monotonic() + 30
        while worker.running and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(TakeTimeout, match=r"take\(2\) timed out after 1 s with 0 of 2 groups"):
            worker.check_health(60.0)
        with pytest.raises(TakeTimeout):
            worker.commit_step(1)
    finally:
        worker.stop()
