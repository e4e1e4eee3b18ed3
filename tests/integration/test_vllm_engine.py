"""`rollstream produce --engine vllm` end to end on a real broker, against the vLLM stand-in
(tests/standins/vllm_server.py, which cites the vllm-project/vllm files and commits it follows).

Pinned: the CLI's ``--engine vllm --vllm-url URL`` publishes one ok group per prompt, each with
``--n-samples`` samples whose token ids and logprobs are exactly the server's, the prompt's token ids
as vLLM tokenized it and the sampling parameters, and a `RolloutConsumer` takes them all; an in-process
producer whose vLLM server aborts samples (a trainer's ``/pause?mode=abort``) ships only finished samples,
continued from their partial output, stamped with the newest version announced on NS.control (vLLM reports
none per request); a server paused (``/pause?mode=abort`` .. ``/resume``, a weight update) for longer than
the intake's stall rule while every generation slot is busy publishes every group once and replaces no
client (issue 40).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from rollstream.consumers import RolloutConsumer
from rollstream.infra import KafkaConfig, announce_policy_version
from rollstream.producers import RetryPolicy, RolloutProducer, make_engine
from rollstream.producers.engines import VLLMHTTPEngine
from rollstream.schemas import PolicyVersion, Sampling

from tests.integration._kafka import committed_everything, count, read_all, run_cli, write_prompts
from tests.integration.test_policy_versions import running, settings, wait_for
from tests.standins.vllm_server import VLLMStandIn, logprob_at, token_at

PROMPTS, SAMPLES, TOKENS = 4, 3, 5


@pytest.fixture
def vllm() -> Iterator[VLLMStandIn]:
    with VLLMStandIn() as server:
        yield server


def test_cli_produces_groups_a_consumer_takes(kafka_config: KafkaConfig, namespace_factory, group_id,
                                              bootstrap_servers: str, vllm: VLLMStandIn) -> None:
    names = namespace_factory(partitions=2)
    write_prompts(kafka_config, names, [f"p{i}" for i in range(PROMPTS)])
    produced = run_cli(bootstrap_servers, "produce", "--namespace", names.namespace, "--engine", "vllm",
                       "--vllm-url", vllm.url, "--n-samples", str(SAMPLES), "--max-new-tokens", str(TOKENS),
                       "--temperature", "0.8", "--concurrency", "2", "--max-lag", "100", "--trainer-group", group_id,
                       "--exit-when-idle", "1.5", "--summary-interval", "0", timeout_s=90)
    assert produced.returncode == 0, produced.stdout + produced.stderr
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, filters=()) as trainer:
        batch = trainer.take(PROMPTS, timeout=30)
        trainer.commit(batch)
    assert sorted(g.prompt_id for g in batch.groups) == [f"p{i}" for i in range(PROMPTS)]
    for group in batch.groups:
        assert group.status == "ok" and len(group.samples) == SAMPLES
        assert list(group.prompt_tokens) == [ord(ch) for ch in f"question {group.prompt_id}"]
        assert group.sampling == Sampling(temperature=0.8, top_p=1.0, top_k=-1)
        start = len(group.prompt_tokens)
        for sample in group.samples:
            assert list(sample.tokens) == [token_at(start + i) for i in range(TOKENS)]
            assert sample.logprobs is not None
            assert list(sample.logprobs) == pytest.approx([logprob_at(start + i) for i in range(TOKENS)], abs=1e-6)
            assert sample.finish_reason == "length"
    assert len(vllm.completions()) == PROMPTS * SAMPLES  # one request per sample, none retried
    assert all(body["model"] == vllm.model and body["temperature"] == 0.8 for body in vllm.completions())


def test_aborted_samples_are_continued_and_stamped_from_control(kafka_config: KafkaConfig, namespace_factory,
                                                                  vllm: VLLMStandIn) -> None:
    names = namespace_factory(partitions=1)
    announce_policy_version(kafka_config, names, PolicyVersion(3))
    vllm.abort_next = 2  # as a trainer's /pause?mode=abort does to the requests in flight
    engine = make_engine("vllm", vllm_urls=[vllm.url])
    producer = RolloutProducer(engine, settings(names, n_samples=2, max_new_tokens=TOKENS), kafka=kafka_config)
    with running(producer):
        wait_for(lambda: producer.policy_version == 3, "the producer to see version 3")
        write_prompts(kafka_config, names, ["a", "b"])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 2, "2 groups")
    groups = read_all(kafka_config, names.rollouts)
    assert all(g.status == "ok" for g in groups), [g.error for g in groups]
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4 and all(s.finish_reason == "length" and len(s.tokens) == TOKENS for s in samples)
    assert all(s.weight_versions == (3,) for s in samples)
    assert len(vllm.completions()) == 4 + 2  # the two aborted samples were continued
    continued = [b for b in vllm.completions() if b["max_tokens"] < TOKENS]  # after the token each abort had
    assert len(continued) == 2 and all(len(b["prompt"]) + b["max_tokens"] == len(continued[0]["prompt"]) +
                                       continued[0]["max_tokens"] for b in continued)


def test_a_pause_longer_than_the_intake_stall_rule_publishes_no_group_twice(
        kafka_config: KafkaConfig, namespace_factory, vllm: VLLMStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every slot busy and the hand-over queue full while the server is paused past the stall time: the
    producer is waiting on its engine, not stalled, so its intake client stays and nothing is generated twice."""
    import rollstream.producers._intake_stall as stall_module

    stall_s, concurrency, prompts = 4.0, 2, [f"w{i}" for i in range(6)]  # more prompts than slots and queue
    monkeypatch.setattr(stall_module, "_MIN_STALL_S", stall_s)  # stall_s = max(this, 2 x session timeout)
    names = namespace_factory(partitions=1)
    vllm.token_delay_s = 0.2  # a sample takes a second: the slots are busy when the pause comes
    engine = VLLMHTTPEngine([vllm.url], retry=RetryPolicy(max_backoff_s=0.5))  # back soon after /resume
    # The broker holds each fetch of intake 0.5 s, as a remote cluster may take for the first fetch after the
    # partitions resume: longer than one of intake's polls, so a probe comes before the next prompt does.
    slow_fetch = {"fetch.min.bytes": 1 << 20, "fetch.wait.max.ms": 500}
    producer = RolloutProducer(engine, settings(names, n_samples=2, concurrency=concurrency, max_new_tokens=TOKENS,
                                                session_timeout_s=stall_s / 2, intake_overrides=slow_fetch),
                               kafka=kafka_config)
    intake_group = producer.settings.effective_intake_group
    with running(producer), httpx.Client(base_url=vllm.url, timeout=10) as http:
        write_prompts(kafka_config, names, prompts)
        wait_for(lambda: vllm.in_flight() == 2 * concurrency and producer.stats().buffered == concurrency,
                 "every slot generating and the queue full")
        http.post("/pause", params={"mode": "abort"}).raise_for_status()
        time.sleep(stall_s + 2.0)
        http.post("/resume").raise_for_status()
        wait_for(lambda: committed_everything(kafka_config, intake_group, names.prompts), "every prompt committed")
        replaced = producer.registry.get_sample_value("rollstream_producer_client_replacements_total",
                                                      {"role": "intake"})
    groups = read_all(kafka_config, names.rollouts)
    twice = sorted({g.prompt_id for g in groups if sum(h.group_id == g.group_id for h in groups) > 1})
    assert not twice, f"groups of prompts {twice} published twice"
    assert sorted(g.prompt_id for g in groups) == sorted(prompts) and all(g.status == "ok" for g in groups)
    assert replaced == 0, "the intake client was replaced while the producer waited on its paused engine"
