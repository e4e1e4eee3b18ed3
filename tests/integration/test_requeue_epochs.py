"""Every prompt of every epoch trained once, though the policy moves on every step (issue 12's "done when").

A real producer (in-process, a custom generate function of ~50 ms, `--max-attempts 8`) generates two
epochs of prompts; a trainer process announces a new policy version at every step and takes with
``max_staleness=1``, so groups that waited in the lag go stale and are requeued instead of burned. The
trainer is SIGKILLed in the middle of a step (taken, not committed) and started again.

Pinned: every prompt of both epochs is taken exactly once (effective manifests), some were requeued
first (the run is not vacuous), the offset audit passes, and the epoch audit is green with nothing in
flight.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rollstream.consumers import audit, audit_epochs
from rollstream.consumers._ledger import StepLedger
from rollstream.consumers._manifests import read_manifests
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.producers.prompts import publish_prompts
from rollstream.schemas import Prompt, make_group_id

from tests import plugins
from tests.integration.test_policy_versions import running

TRAINER = Path(__file__).with_name("_requeue_trainer.py")
PROMPTS, EPOCHS, N = 16, 2, 4


def _trainer(bootstrap: str, names: TopicNames, group: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(TRAINER), bootstrap, names.namespace, group, str(N), "1"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])


def _steps(trainer: subprocess.Popen[str], count: int | None) -> list[dict[str, object]]:
    """Read `count` step lines (None: until it exits)."""
    assert trainer.stdout is not None
    rows: list[dict[str, object]] = []
    while count is None or len(rows) < count:
        line = trainer.stdout.readline()
        if not line:
            break
        rows.append(json.loads(line))
    return rows


@pytest.mark.slow
def test_stale_groups_are_requeued_and_every_prompt_is_trained_once(bootstrap_servers: str,
                                                                    kafka_config: KafkaConfig, namespace_factory,
                                                                    group_id: str, monkeypatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_TEST_GEN_DELAY_S", "0.05")
    names = namespace_factory(partitions=2)
    publish_prompts([Prompt(id=f"q{i:02d}", prompt=f"question {i}", label="1") for i in range(PROMPTS)],
                    kafka_config, names.prompts, epochs=EPOCHS)
    settings = ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=4, max_lag=8,
                                trainer_group=group_id, max_attempts=8, summary_interval_s=0, producer_id="rq")
    with running(RolloutProducer(plugins.slow, settings, kafka=kafka_config, reward=plugins.alternating)):
        first = _trainer(bootstrap_servers, names, group_id)
        before = _steps(first, 3)
        first.send_signal(signal.SIGKILL)  # in its optimizer step: taken, not committed
        first.wait(10)
        second = _trainer(bootstrap_servers, names, group_id)
        after = _steps(second, None)
        assert second.wait(60) == 0

    ledger = StepLedger(keep_manifests=True)
    for manifest in read_manifests(kafka_config, names.steps, group_id):
        ledger.add(manifest)
    effective = ledger.effective()
    taken = Counter(d.group_id for m in effective for d in m.dispositions if d.kind == "taken")
    wanted = {make_group_id(f"q{i:02d}", e) for i in range(PROMPTS) for e in range(EPOCHS)}
    assert set(taken) == wanted and set(taken.values()) == {1}, taken
    requeued = sum(1 for m in effective for d in m.dispositions if d.kind == "requeued")
    assert requeued > 0, "no group went stale: the run proves nothing"
    assert sum(int(r["requeued"]) for r in before + after) >= requeued  # includes the redone step's
    assert audit(kafka_config, names.namespace, group_id).ok
    report = audit_epochs(kafka_config, names.namespace, group_id)
    assert report.ok and not report.in_flight, report.summary()
