"""The embedded path end to end: the locally built tiny model through `HFEngine`, a built-in reward, real
records on NS.rollouts, stamped with the policy version announced on NS.control and carrying the sampling
parameters that shaped their logprobs (schema v4)."""

from __future__ import annotations

import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import HFEngine, ProducerSettings, RolloutProducer, build_tiny_model
from rollstream.schemas import PolicyVersion, Sampling, encode

from tests.integration._kafka import lag, read_all, write_prompts

pytest.importorskip("transformers")


def test_tiny_model_groups_on_kafka(kafka_config: KafkaConfig, namespace_factory, tmp_path) -> None:
    from confluent_kafka import Producer

    names = namespace_factory(partitions=1)
    control = Producer(kafka_config.producer())
    control.produce(names.control, encode(PolicyVersion(version=5, weights_path="/ckpt/5")), key=b"policy")
    control.flush(10)
    write_prompts(kafka_config, names, ["m1", "m2", "m3"], label="4")
    model = build_tiny_model(tmp_path / "tiny")
    settings = ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=2, max_lag=100, max_new_tokens=8,
                                temperature=0.7, top_p=0.9, exit_when_idle_s=0.5, summary_interval_s=0)
    stats = RolloutProducer(HFEngine(model), settings, kafka=kafka_config, reward="math").run_sync(
        handle_signals=False)
    assert stats.groups_ok == 3
    for group in read_all(kafka_config, names.rollouts):
        assert group.status == "ok" and group.prompt.startswith("<|im_start|>user\nquestion")
        assert group.sampling == Sampling(temperature=0.7, top_p=0.9, top_k=-1)
        assert len(group.prompt_tokens) > 10 and len(group.samples) == 2
        for sample in group.samples:
            assert sample.logprobs is not None and len(sample.logprobs) == len(sample.tokens) > 0
            assert sample.reward in (0.0, 1.0) and sample.weight_versions == (5,)
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0
