"""A prompt partition left to no member by a half-done cooperative rebalance is handed out again.

Pinned: a bare static librdkafka member ``p1`` (cooperative-sticky, the producers' prompt group) owns both prompt
partitions; a `RolloutProducer` (``p0``) joins, so the first round of the rebalance takes partition 0 from p1,
which is SIGKILLed inside its revocation callback (before it joins again for the second round) and restarted
with the same ``group.instance.id`` within its session. The coordinator hands the restarted p1 partition 1
without a rebalance, and partition 0 is assigned to no member of the stable group. The producer, starved, finds
it orphaned and leaves and joins the group again: it then generates every prompt of partition 0, and counts one
orphan rejoin. Without the rejoin it would wait for the next change of membership (10 minutes in
``tests.chaos.inflight``, until the run gave up).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import rollstream.producers._intake_stall as stall_module
from rollstream.infra import KafkaConfig
from rollstream.infra.clients import open_producer
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.schemas import Prompt, encode

from tests.integration._kafka import read_all
from tests.integration.test_policy_versions import running, wait_for

SESSION_S = 6.0  # the bare member restarts well within it (a Python start); a 4-5 s stall of this machine too

BARE_MEMBER = """
import sys, time
from confluent_kafka import Consumer
bootstrap, group, topic, mode = sys.argv[1:5]
consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "group.instance.id": "p1",
                     "partition.assignment.strategy": "cooperative-sticky", "session.timeout.ms": SESSION_MS,
                     "enable.auto.commit": False, "auto.offset.reset": "earliest"})
def on_assign(c, partitions):
    print("assigned", sorted(p.partition for p in partitions), flush=True)
def on_revoke(c, partitions):
    print("revoking", sorted(p.partition for p in partitions), flush=True)
    if mode == "block":
        time.sleep(600)  # a long drain, killed part way
consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
while True:
    consumer.poll(0.2)
""".replace("SESSION_MS", str(int(SESSION_S * 1000)))


async def generate(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    await asyncio.sleep(0.01)
    return [{"text": "42", "tokens": [1, 2], "logprobs": [-0.5] * 2, "finish_reason": "stop"} for _ in range(n)]


def bare_member(kafka_config: KafkaConfig, group: str, topic: str, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", BARE_MEMBER, kafka_config.bootstrap_servers, group, topic, mode],
                            stdout=subprocess.PIPE, text=True)


def wait_line(member: subprocess.Popen[str], expected: str) -> None:
    """Read `member`'s lines until `expected` (the pytest timeout bounds a member that never says it)."""
    assert member.stdout is not None
    seen = []
    while (line := member.stdout.readline()) and line.strip() != expected:
        seen.append(line.strip())
    assert line.strip() == expected, f"the bare member said {seen}, not {expected!r}"


@pytest.mark.timeout(240)
def test_a_partition_left_unassigned_by_a_member_restarted_mid_rebalance_is_assigned_again(
        kafka_config: KafkaConfig, namespace_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stall_module, "_MIN_STALL_S", 2 * SESSION_S)  # the floor's 20 s would only add waiting
    names = namespace_factory(partitions=2)
    settings = ProducerSettings(namespace=names.namespace, producer_id="p0", n_samples=2, concurrency=2,
                                max_lag=100_000, session_timeout_s=SESSION_S, drain_on_revoke_s=1.0,
                                summary_interval_s=0, watch_control=False, group_protocol="classic")
    group = settings.effective_intake_group
    prompts = {partition: [f"q{partition}-{i}" for i in range(4)] for partition in (0, 1)}
    producer_client = open_producer(kafka_config.producer())
    for partition, ids in prompts.items():
        for prompt_id in ids:
            producer_client.produce(names.prompts, encode(Prompt(id=prompt_id, prompt="2+40?", label="42")),
                                    key=prompt_id.encode(), partition=partition)
    assert producer_client.flush(30) == 0, "prompts not written"
    members = [bare_member(kafka_config, group, names.prompts, "block")]
    try:
        wait_line(members[0], "assigned [0, 1]")
        producer = RolloutProducer(generate, settings, kafka=kafka_config)
        with running(producer):
            wait_line(members[0], "revoking [0]")  # the first round took partition 0, for p0
            members[0].kill()  # before p1 joins again: nobody asks for the second round
            members[0].wait()
            members.append(bare_member(kafka_config, group, names.prompts, "hold"))
            wait_line(members[1], "assigned [1]")  # its stored assignment, handed back without a rebalance
            wait_for(lambda: {g.prompt_id for g in read_all(kafka_config, names.rollouts, timeout_s=2)}
                     >= set(prompts[0]), "every prompt of partition 0 generated", timeout_s=120)
            rejoins = producer.registry.get_sample_value("rollstream_producer_orphan_rejoins_total")
        assert rejoins == 1, f"{rejoins} rejoins of the producer for orphaned partitions, expected 1"
    finally:
        for member in members:
            member.kill()
            member.wait()
