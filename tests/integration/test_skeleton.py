"""The walking skeleton, end to end through the real CLI and broker: load 10 prompts, run a producer
until it is idle, take 4 then 6 as a trainer. Nothing is missing, nothing repeats, and the audit of the
trainer group passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rollstream.consumers import RolloutConsumer, TakeTimeout
from rollstream.infra import TopicNames

REPO = Path(__file__).resolve().parents[2]


def rollstream(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rollstream", *args], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout)


def test_load_produce_take_4_then_6(bootstrap_servers: str, namespace: TopicNames, group_id: str,
                                    tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n"
                               for i in range(10)))
    loaded = rollstream("prompts", "load", str(prompts), "--namespace", namespace.namespace)
    assert loaded.returncode == 0, loaded.stderr
    produced = rollstream("produce", "--namespace", namespace.namespace, "--generate", "tests.plugins:instant",
                          "--reward", "tests.plugins:reward", "--n-samples", "4", "--concurrency", "4",
                          "--max-lag", "100", "--trainer-group", group_id, "--exit-when-idle", "3")
    assert produced.returncode == 0, produced.stderr

    with RolloutConsumer(bootstrap_servers, group_id=group_id, namespace=namespace.namespace,
                         filters=()) as trainer:
        first = trainer.take(4, timeout=30)
        second = trainer.take(6, timeout=30)
        try:
            trainer.take(1, timeout=1)
            raise AssertionError("an 11th group was taken from 10 prompts")
        except TakeTimeout:
            pass
        assert trainer.lag().total == 0
    taken = [g.prompt_id for g in first.groups + second.groups]
    assert len(first.groups) == 4 and len(second.groups) == 6
    assert sorted(taken) == sorted(f"q{i}" for i in range(10))
    assert all(len(g.samples) == 4 and g.status == "ok" for g in first.groups + second.groups)

    audit = rollstream("audit", "--namespace", namespace.namespace, "--group", group_id)
    assert audit.returncode == 0, audit.stdout + audit.stderr
