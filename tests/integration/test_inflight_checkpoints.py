"""In-flight checkpoints end to end: a producer SIGKILLed in the middle of multi-turn episodes costs them no turn.

Real processes: `rollstream produce --engine hf --environment tests.plugins:SlowCountingEnvironment` (P1) plays
episodes of several turns (each reply takes a moment; the environment keeps its count through
``snapshot``/``restore``). Once NS.inflight holds a checkpoint of an episode at least two turns in, P1 is
SIGKILLed; the checkpoints it left are read, and P2 takes the prompts over. We check:

- every prompt ends as one ok group, each taken once by a trainer (0 lost, 0 duplicated);
- every sample P1 had checkpointed and P2 published starts with exactly the checkpoint's tokens, loss mask
  and logprobs, and says it was resumed there from P1's checkpoint (``resume_points``, ``resumed_from``);
  the environment went on from its snapshot (its next reply is ``[N+1]``, not ``[1]`` again);
- NS.inflight holds no live checkpoint once P2 is done (each published group tombstoned its samples), and no
  tombstone of a key that never had a checkpoint (a sample done within its first interval writes nothing).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, TopicNames

from tests.integration._inflight import newest_checkpoints, watch_checkpoints
from tests.integration._kafka import REPO_ROOT, cli_env, read_all, write_prompts

pytest.importorskip("transformers")
from rollstream.demo.task import build_demo_model  # noqa: E402

PROMPTS = [f"q{i}" for i in range(3)]
SAMPLES, REPLIES = 2, 5


def produce(bootstrap: str, names: TopicNames, model: Path, producer_id: str, log: Path,
            *args: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "rollstream", "produce", "-N", names.namespace, "--engine", "hf",
             "--model", str(model), "--environment", "tests.plugins:SlowCountingEnvironment", "--max-turns", "8",
             "--max-new-tokens", "3", "--n-samples", str(SAMPLES), "--concurrency", str(len(PROMPTS)),
             "--max-lag", "100", "--producer-id", producer_id, "--session-timeout", "2", "--summary-interval", "0",
             "--checkpoint-interval", "30", *args], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env=cli_env(bootstrap, ROLLSTREAM_TEST_REPLY_DELAY_S="0.4", ROLLSTREAM_TEST_REPLIES=str(REPLIES)))


@pytest.mark.timeout(300)
def test_a_producer_killed_mid_episode_leaves_checkpoints_its_successor_continues(
        kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory, group_id: str, tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)
    model = build_demo_model(tmp_path / "model")
    write_prompts(kafka_config, names, PROMPTS)
    victim = produce(bootstrap_servers, names, model, "P1", tmp_path / "p1.log")
    try:
        watch_checkpoints(kafka_config, names.inflight, lambda newest: any(
            c is not None and c.finish_reason is None and c.policy_turns >= 2 for c in newest.values()), timeout_s=120)
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
    left = {k: c for k, c in newest_checkpoints(kafka_config, names.inflight).items() if c is not None}
    assert left and all(c.producer_id == "P1" for c in left.values())

    survivor = produce(bootstrap_servers, names, model, "P2", tmp_path / "p2.log", "--exit-when-idle", "3")
    assert survivor.wait(180) == 0, (tmp_path / "p2.log").read_text()[-3000:]

    groups = {g.group_id: g for g in read_all(kafka_config, names.rollouts)}
    assert sorted(g.prompt_id for g in groups.values()) == sorted(PROMPTS)  # (a group published twice: once here)
    resumed = 0
    for checkpoint in left.values():
        group = groups[checkpoint.group_id]
        if group.producer_id != "P2":
            continue  # P1 published it before the kill
        sample = group.samples[checkpoint.sample_index]
        n = len(checkpoint.tokens)
        assert sample.tokens[:n].tolist() == checkpoint.tokens.tolist()
        assert sample.loss_mask is not None and checkpoint.loss_mask is not None
        assert sample.loss_mask[:n].tolist() == checkpoint.loss_mask.tolist()
        assert sample.logprobs is not None and checkpoint.logprobs is not None
        assert sample.logprobs[:n].tolist() == pytest.approx(checkpoint.logprobs.tolist())
        assert list(sample.resume_points) == [n] and list(sample.resumed_from) == ["P1"]
        if checkpoint.finish_reason is None:
            resumed += 1
            assert _replies(group.samples[checkpoint.sample_index].loss_mask.tolist()) == REPLIES  # no reply lost
    assert resumed, f"no episode was resumed mid-way: {[(c.key, c.policy_turns) for c in left.values()]}"
    assert all(g.status == "ok" for g in groups.values()), [g.error for g in groups.values()]

    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=()) as trainer:
        batch = trainer.take(len(PROMPTS), timeout=30)
        trainer.commit(batch)
    assert sorted(g.prompt_id for g in batch.groups) == sorted(PROMPTS)
    checkpointed: set[str] = set()
    newest = newest_checkpoints(kafka_config, names.inflight, checkpointed=checkpointed)
    assert not [k for k, c in newest.items() if c is not None]
    assert set(newest) == checkpointed  # a tombstone only where a checkpoint was: a sample never saved writes none


def _replies(mask: list[int]) -> int:
    """How many tool segments (runs of 0) a loss mask has."""
    return sum(1 for i, m in enumerate(mask) if m == 0 and (i == 0 or mask[i - 1] == 1))
