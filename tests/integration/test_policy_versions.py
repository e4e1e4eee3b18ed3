"""Policy versions through NS.control, end to end on a real broker.

Pinned: an HF producer that is running loads the weights of a version announced on NS.control and
stamps that version on everything it generates from then on (and the samples really come from the new
weights: their logprobs are the new model's); a producer whose engine cannot load weights stamps the
latest announced version; the trainer's consumer filters groups more than ``max_staleness`` versions
behind its policy version, requeues their prompts (stale is a passing reason) and records them in the step
manifest, and the audit still passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, audit, default_filters
from rollstream.infra import KafkaConfig, TopicNames, announce_policy_version
from rollstream.producers import ProducerSettings, RolloutProducer
from rollstream.schemas import PolicyVersion, Prompt, ScoredGroup, make_group_id, write_policy_version

from tests import plugins
from tests.integration._kafka import count, read_all, read_records, write_prompts


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextmanager
def running(producer: RolloutProducer) -> Iterator[RolloutProducer]:
    """Run `producer` in a thread for the block; stop it and re-raise what it raised."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            producer.run_sync(handle_signals=False)
        except BaseException as exc:  # surfaced in the test thread below
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-producer")
    thread.start()
    try:
        yield producer
    finally:
        producer.stop()
        thread.join(60)
    assert not thread.is_alive(), "producer did not stop"
    if errors:
        raise errors[0]


def settings(names: TopicNames, **overrides: object) -> ProducerSettings:
    base: dict[str, object] = {"namespace": names.namespace, "n_samples": 4, "concurrency": 2, "max_lag": 1000,
                               "summary_interval_s": 0, "max_new_tokens": 2}
    return ProducerSettings(**{**base, **overrides})  # type: ignore[arg-type]


def sample_logprobs_under(model_dir: Path, group: ScoredGroup) -> list[list[float]]:
    """Each sample's response-token logprobs recomputed with the model in `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    out = []
    for s in group.samples:
        ids = torch.tensor([list(group.prompt_tokens) + list(s.tokens)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
        positions = range(len(group.prompt_tokens) - 1, ids.shape[1] - 1)
        out.append([float(logits[p, ids[0, p + 1]]) for p in positions])
    return out


def test_hf_producer_loads_an_announced_version_and_stamps_it(kafka_config: KafkaConfig, namespace_factory,
                                                              tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from rollstream.producers import HFEngine

    from rollstream.demo.task import build_demo_model

    names = namespace_factory(partitions=1)
    v0 = build_demo_model(tmp_path / "v0", seed=0)
    write_policy_version(v0, 0)
    v1 = build_demo_model(tmp_path / "v1", seed=1)  # other weights, same architecture and tokenizer
    engine = HFEngine(v0, torch_threads=1)
    producer = RolloutProducer(engine, settings(names), kafka=kafka_config, reward="rollstream.demo.task:reward")
    with running(producer):
        write_prompts(kafka_config, names, [f"before-{i}" for i in range(3)], label="9")
        wait_for(lambda: count(kafka_config, names.rollouts) >= 3, "3 groups from version 0")
        announce_policy_version(kafka_config, names, PolicyVersion(1, weights_path=str(v1)))
        wait_for(lambda: engine.policy_version == 1, "the producer to load version 1")
        write_prompts(kafka_config, names, [f"after-{i}" for i in range(3)], label="9")
        wait_for(lambda: count(kafka_config, names.rollouts) >= 6, "3 groups from version 1")
    groups = {g.prompt_id: g for g in read_all(kafka_config, names.rollouts)}
    assert len(groups) == 6 and all(g.status == "ok" for g in groups.values())
    for prompt_id, group in groups.items():
        version, weights = (0, v0) if prompt_id.startswith("before") else (1, v1)
        assert {s.weight_versions for s in group.samples} == {(version,)}, prompt_id
        recomputed = sample_logprobs_under(weights, group)
        for sample, expected in zip(group.samples, recomputed, strict=True):
            assert sample.logprobs == pytest.approx(expected, abs=1e-4), prompt_id


def test_consumer_filters_groups_too_many_announced_versions_behind(kafka_config: KafkaConfig, namespace_factory,
                                                                    group_id: str) -> None:
    names = namespace_factory(partitions=1)
    announce_policy_version(kafka_config, names, PolicyVersion(1))
    producer = RolloutProducer(plugins.instant, settings(names), kafka=kafka_config, reward="tests.plugins:reward")
    with running(producer):
        wait_for(lambda: producer.policy_version == 1, "the producer to read version 1")
        write_prompts(kafka_config, names, [f"old-{i}" for i in range(3)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 3, "3 groups at version 1")
        announce_policy_version(kafka_config, names, PolicyVersion(5))
        wait_for(lambda: producer.policy_version == 5, "the producer to read version 5")
        write_prompts(kafka_config, names, [f"new-{i}" for i in range(3)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 6, "3 groups at version 5")

    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace,
                         filters=default_filters(dynamic_sampling=False), max_staleness=2) as trainer:
        batch = trainer.take(3, timeout=30, policy_version=6)
    assert sorted(g.prompt_id for g in batch.groups) == ["new-0", "new-1", "new-2"]
    assert all(s.weight_versions == (5,) for g in batch.groups for s in g.samples)
    # Stale is a passing reason: the producer's groups carry their prompt record, so they are requeued.
    requeued = [d for d in batch.dispositions if d.kind == "requeued"]
    assert sorted(d.group_id or "" for d in requeued) == sorted(make_group_id(f"old-{i}", 0) for i in range(3))
    assert all(d.reason == "stale: 5 versions behind (max 2)" and d.attempt == 0 for d in requeued)
    again = [p for _, _, p in read_records(kafka_config, names.prompts, Prompt) if p.attempt]
    assert sorted((p.id, p.attempt, p.label) for p in again) == [(f"old-{i}", 1, "42") for i in range(3)]
    report = audit(kafka_config, names.namespace, group_id)
    assert report.ok, report.summary()
    assert report.counts["requeued"] == 3 and report.counts["taken"] == 3
