"""Everything is accounted: a group that cannot be generated (after retries), scored, encoded within the size
limit, or whose prompt record is garbage is still published, as a failed record carrying its error, and
its prompt is committed like any other."""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka import Producer
from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings, PromptFileError, RolloutProducer, load_prompts

from tests import plugins
from tests.integration._kafka import count, lag, read_all, write_prompts

attempts: dict[str, int] = {}


async def flaky(prompt: dict[str, Any], n: int, sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
    """Fails the first attempt of every prompt (retried), always fails engine-fail-*, oversizes big-*."""
    attempts[prompt["id"]] = attempts.get(prompt["id"], 0) + 1
    if attempts[prompt["id"]] == 1:
        raise ConnectionError("transient")
    if prompt["id"].startswith("big"):
        return [{"text": "x", "tokens": list(range(200_000)), "finish_reason": "length"}] * n
    return await plugins.instant(prompt, n, sampling_params)


def test_engine_reward_size_and_decode_failures_are_published(kafka_config: KafkaConfig, namespace_factory,
                                                              group_id: str) -> None:
    names = namespace_factory(partitions=2, max_message_bytes=1024 * 1024)  # the producer sizes itself from it
    write_prompts(kafka_config, names, ["ok-1", "ok-2", "engine-fail-1", "reward-fail-1", "big-1"])
    garbage = Producer(kafka_config.producer())
    garbage.produce(names.prompts, value=b"not avro at all", key=b"junk")
    garbage.flush(10)
    s = ProducerSettings(namespace=names.namespace, n_samples=2, concurrency=4, trainer_group=group_id,
                         max_lag=100, generate_attempts=2, retry_backoff_s=0.01, exit_when_idle_s=0.5,
                         summary_interval_s=0, watch_control=False)
    stats = RolloutProducer(flaky, s, kafka=kafka_config, reward="tests.plugins:reward").run_sync(handle_signals=False)

    groups = {g.prompt_id: g for g in read_all(kafka_config, names.rollouts)}
    assert stats.groups_ok == 2 and stats.groups_failed == 4 and len(groups) == 6
    for pid in ("ok-1", "ok-2"):
        assert groups[pid].status == "ok" and groups[pid].rewards == [1.0, 1.0]
        assert attempts[pid] == 2  # one transient failure, retried
    engine = groups["engine-fail-1"]
    assert engine.status == "failed" and "engine exploded" in (engine.error or "") and engine.samples == ()
    reward = groups["reward-fail-1"]
    assert reward.status == "failed" and "reward exploded" in (reward.error or "")
    assert len(reward.samples) == 2 and reward.rewards == [None, None]  # what exists is kept
    big = groups["big-1"]
    assert big.status == "failed" and "exceeds max_message_bytes=1048576" in (big.error or "")
    junk = next(g for pid, g in groups.items() if pid.startswith("undecodable:"))
    assert junk.status == "failed" and "undecodable prompt" in (junk.error or "")
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 0  # all accounted, all committed


def test_a_prompt_too_large_for_the_topic_refuses_the_whole_file(kafka_config: KafkaConfig, namespace_factory,
                                                                 tmp_path) -> None:
    """A topic with a smaller max.message.bytes used to take the prompts that fit and refuse the rest:
    a partial load. Now the file loads whole or not at all, and the error names the line."""
    names = namespace_factory(partitions=1, max_message_bytes=64 * 1024)
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "small", "prompt": "2+2="}\n' + json.dumps({"id": "huge", "prompt": "y" * 100_000})
                    + '\n{"id": "after", "prompt": "3+3="}\n')
    with pytest.raises(PromptFileError, match=r"prompts.jsonl:2: prompt 'huge' makes a record of \d+ bytes, above "
                                              rf"{names.prompts}'s max.message.bytes=65536"):
        load_prompts(path, kafka_config, namespace=names.namespace)
    assert count(kafka_config, names.prompts) == 0  # nothing from the file
    path.write_text('{"id": "small", "prompt": "2+2="}\n{"id": "after", "prompt": "3+3="}\n')
    assert load_prompts(path, kafka_config, namespace=names.namespace, epochs=2) == 4
