"""A producer that owns its SGLang servers' weights (``--sglang-sync-weights``), end to end on a real broker,
against two stand-in SGLang servers (tests/standins/sglang_server.py).

Pinned: a policy version announced on NS.control with a weights_path makes the producer pause, update
(``model_path``, ``weight_version``) and continue every server, and the groups generated afterwards carry
the new version; a group in flight during the update is continued on the new weights and its samples
carry both versions (tokens and logprobs exactly the old weights' then the new weights'), their staleness
counting from the oldest.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rollstream.infra import KafkaConfig, TopicNames, announce_policy_version
from rollstream.producers import RolloutProducer, make_engine
from rollstream.schemas import PolicyVersion, ScoredGroup

from tests.integration._kafka import count, read_all, write_prompts
from tests.integration.test_policy_versions import running, settings, wait_for
from tests.standins.sglang_server import SGLangStandIn, logprob_at, token_at

pytest.importorskip("transformers")  # the producer sends token ids: a real tokenizer from --tokenizer
SYNC_PATHS = ["/pause_generation", "/update_weights_from_disk", "/continue_generation"]


@pytest.fixture
def servers() -> Iterator[list[SGLangStandIn]]:
    with SGLangStandIn(weight_version="0", token_delay_s=0.002) as a, \
            SGLangStandIn(weight_version="0", token_delay_s=0.002) as b:
        yield [a, b]


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    from rollstream.producers.engines.tiny_model import build_tokenizer

    return build_tokenizer(tmp_path / "tokenizer")


def synced_producer(names: TopicNames, kafka_config: KafkaConfig, servers: list[SGLangStandIn], tokenizer: Path,
                    max_new_tokens: int = 24) -> RolloutProducer:
    engine = make_engine("sglang", sglang_urls=[s.url for s in servers], tokenizer=tokenizer,
                         sglang_sync_weights=True)
    return RolloutProducer(engine, settings(names, n_samples=2, max_new_tokens=max_new_tokens), kafka=kafka_config)


def by_prompt(kafka_config: KafkaConfig, names: TopicNames) -> dict[str, ScoredGroup]:
    groups = {g.prompt_id: g for g in read_all(kafka_config, names.rollouts)}
    assert all(g.status == "ok" for g in groups.values()), [g.error for g in groups.values()]
    return groups


def test_producer_updates_its_servers_and_stamps_the_new_version(kafka_config: KafkaConfig, namespace_factory,
                                                                 servers: list[SGLangStandIn], tokenizer: Path,
                                                                 tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)
    weights = tmp_path / "v1"
    weights.mkdir()
    producer = synced_producer(names, kafka_config, servers, tokenizer)
    with running(producer):
        write_prompts(kafka_config, names, [f"before-{i}" for i in range(2)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 2, "2 groups on version 0")
        announce_policy_version(kafka_config, names, PolicyVersion(1, weights_path=str(weights)))
        wait_for(lambda: all(s.weight_version == "1" for s in servers), "both servers to serve version 1")
        write_prompts(kafka_config, names, [f"after-{i}" for i in range(2)])
        wait_for(lambda: count(kafka_config, names.rollouts) >= 4, "2 groups on version 1")
    for server in servers:
        sync = [(p, body) for p, body in list(server.requests) if p in SYNC_PATHS]
        assert sync == [("/pause_generation", {"mode": "abort"}),
                        ("/update_weights_from_disk", {"model_path": str(weights), "weight_version": "1"}),
                        ("/continue_generation", {})]
    for prompt_id, group in by_prompt(kafka_config, names).items():
        version = 0 if prompt_id.startswith("before") else 1
        assert [s.weight_versions for s in group.samples] == [(version,)] * 2, prompt_id


def test_group_in_flight_during_the_update_carries_both_versions(kafka_config: KafkaConfig, namespace_factory,
                                                                 servers: list[SGLangStandIn], tokenizer: Path,
                                                                 tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)
    weights = tmp_path / "v1"
    weights.mkdir()
    for server in servers:
        server.token_delay_s = 0.1  # slow until the update is in: 64 tokens would take 6.4 s
    producer = synced_producer(names, kafka_config, servers, tokenizer, max_new_tokens=64)
    with running(producer):
        write_prompts(kafka_config, names, ["during"])
        wait_for(lambda: all(s.tokens_generated >= 2 for s in servers), "both samples to be under way")
        announce_policy_version(kafka_config, names, PolicyVersion(1, weights_path=str(weights)))
        wait_for(lambda: all(s.weight_version == "1" for s in servers), "both servers to serve version 1")
        for server in servers:
            server.token_delay_s = 0.002
        wait_for(lambda: count(kafka_config, names.rollouts) >= 1, "the group")
    group = by_prompt(kafka_config, names)["during"]
    for sample in group.samples:
        assert sample.weight_versions == (0, 1) and sample.weight_version == 0  # staleness from the oldest
        first, second = sample.version_spans
        assert (first.version, first.start, second.version, second.end) == (0, 0, 1, 64)
        assert len(sample.tokens) == 64 and sample.logprobs is not None and len(sample.logprobs) == 64
        assert list(sample.token_versions()) == [0] * first.end + [1] * (64 - first.end)
        assert sample.finish_reason == "length"
        positions = [len(group.prompt_tokens) + i for i in range(64)]
        versions = [str(v) for v in sample.token_versions()]
        assert list(sample.tokens) == [token_at(p, v) for p, v in zip(positions, versions, strict=True)]
        assert list(sample.logprobs) == pytest.approx([logprob_at(p, v) for p, v in zip(positions, versions,
                                                                                          strict=True)], abs=1e-6)
