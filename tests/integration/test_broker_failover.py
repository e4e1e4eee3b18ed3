"""A Kafka node SIGKILLed mid-run costs the trainer nothing.

A 3-node KRaft cluster on this host (replication 3, min.insync.replicas 2), one `rollstream produce`
process generating (slowly, so work is in flight), and a trainer (`RolloutConsumer`) taking steps. After
the first step the node that leads the rollouts partition is killed with SIGKILL. Writes then wait for
the controller to fence it and elect a new leader (acks=all, the idempotent producer retries without
duplicating), the trainer's fetches and commits follow the new leader and group coordinator, and:

- every prompt's group is taken exactly once over the steps, and nothing fails;
- the audit accounts for every committed offset from the manifests (themselves on a replicated topic);
- the producer, stopped with SIGTERM, drains and exits 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, audit
from rollstream.infra import KafkaConfig, TopicNames, TopicPlan, create_topics
from rollstream.infra.broker import BrokerSpec, broker_status, free_port, start_broker, stop_broker
from rollstream.infra.clients import open_admin

from tests.integration._kafka import REPO_ROOT, cli_env, end_offsets, write_prompts

N = 40  # prompts
STEP = 5  # groups per trainer step
GEN_DELAY_S = "0.25"  # per group (tests.plugins:slow), with concurrency 2: ~5 s of generation in all


@pytest.mark.slow
def test_a_sigkilled_broker_node_loses_nothing(tmp_path: Path) -> None:
    spec = BrokerSpec(port=free_port(3), nodes=3, data_dir=tmp_path / "cluster", heap_mb=384)
    producer: subprocess.Popen[bytes] | None = None
    log_path = tmp_path / "producer.log"
    try:
        config = KafkaConfig(bootstrap_servers=start_broker(spec, timeout=120))
        names = TopicNames("failover")
        create_topics(TopicPlan(names=names, partitions=1, replication_factor=3), config)
        ids = [f"f{i:02d}" for i in range(N)]
        write_prompts(config, names, ids)
        with log_path.open("wb") as log:
            producer = subprocess.Popen(
                [sys.executable, "-m", "rollstream", "produce", "-N", names.namespace,
                 "--generate", "tests.plugins:slow", "--reward", "tests.plugins:reward", "--n-samples", "2",
                 "--concurrency", "2", "--max-lag", "10000", "--trainer-group", "trainer",
                 "--summary-interval", "0"],
                cwd=REPO_ROOT, env=cli_env(config.bootstrap_servers, ROLLSTREAM_TEST_GEN_DELAY_S=GEN_DELAY_S),
                stdout=log, stderr=subprocess.STDOUT)

        taken: list[str] = []
        with RolloutConsumer(config=config, group_id="trainer", namespace=names.namespace, filters=(),
                             timeout=60) as trainer:
            taken += trainer.take(STEP, timeout=60).group_ids
            victim = _leader(config, names.rollouts)
            published_before = end_offsets(config, names.rollouts)[0]
            assert producer.poll() is None and published_before < N, "the kill must land mid-run"
            os.kill(broker_status(spec.data_dir).pids[victim - 1], signal.SIGKILL)
            while len(taken) < N:
                taken += trainer.take(min(STEP, N - len(taken)), timeout=90).group_ids

        assert sorted(Counter(taken).items()) == [(f"{i}#0", 1) for i in ids], _tail(log_path)
        report = audit(config, names.namespace, "trainer", timeout=60)
        assert report.ok, report
        producer.send_signal(signal.SIGTERM)
        assert producer.wait(timeout=60) == 0, _tail(log_path)
    finally:
        if producer is not None and producer.poll() is None:
            producer.kill()
            producer.wait(timeout=10)
        stop_broker(spec.data_dir)
    assert not broker_status(spec.data_dir).running


def _leader(config: KafkaConfig, topic: str) -> int:
    """The node id that leads partition 0 of `topic`."""
    metadata = open_admin(config.admin()).list_topics(topic, timeout=10)
    return metadata.topics[topic].partitions[0].leader


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
