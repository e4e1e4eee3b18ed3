"""Lifecycle of `rollstream produce` and `rollstream prompts load` as a user runs them.

Pinned: SIGTERM drains (exit 0; every group in flight is published and its prompt committed; nothing
beyond them is committed); the metrics endpoint serves the producer's registry; an unreachable broker
is a clear error naming the address and ROLLSTREAM_BOOTSTRAP_SERVERS within the startup timeout; a
missing topic says to run `rollstream topics create`; a prompt file with a bad line names the line and
publishes nothing, a good one is published once per epoch.
"""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
from rollstream.infra import KafkaConfig
from rollstream.producers import ProducerSettings, PromptFileError, RolloutProducer, load_prompts
from rollstream.schemas import Prompt, RollstreamError, decode

from tests import plugins
from tests.integration._kafka import count, end_offsets, lag, read_all, run_cli, start_cli, write_prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return {}
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_sigterm_drains_in_flight_groups_and_commits(kafka_config: KafkaConfig, bootstrap_servers: str,
                                                    namespace_factory) -> None:
    names = namespace_factory(partitions=1)
    write_prompts(kafka_config, names, [f"t{i:02d}" for i in range(12)])
    port = free_port()
    proc = start_cli(bootstrap_servers, "produce", "-N", names.namespace, "--generate", "tests.plugins:slow",
                     "--n-samples", "2", "--concurrency", "4", "--max-lag", "1000", "--metrics-port", str(port),
                     "--summary-interval", "0", ROLLSTREAM_TEST_GEN_DELAY_S="1.5")
    try:
        deadline = time.monotonic() + 30
        while scrape(port).get("rollstream_producer_in_flight_groups", 0) < 4:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "producer never had 4 groups in flight"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert "SIGTERM" in stderr and re.search(r"draining [1-4] in-flight groups", stderr), stderr
    published = sorted(g.prompt_id for g in read_all(kafka_config, names.rollouts))
    assert published[:4] == ["t00", "t01", "t02", "t03"] and len(published) <= 8  # in flight: finished
    assert lag(kafka_config, f"{names.namespace}.producers", names.prompts) == 12 - len(published)


def test_unreachable_broker_is_a_clear_bounded_error(bootstrap_servers: str) -> None:
    started = time.monotonic()
    result = run_cli(bootstrap_servers, "produce", "--bootstrap-servers", "127.0.0.1:1", "--startup-timeout", "3",
                     "--generate", "tests.plugins:instant", timeout_s=30)
    assert result.returncode == 2 and time.monotonic() - started < 15
    assert "cannot reach Kafka at 127.0.0.1:1 within 3 s" in result.stderr
    assert "ROLLSTREAM_BOOTSTRAP_SERVERS" in result.stderr and "Traceback" not in result.stderr


def test_missing_topics_say_how_to_create_them(kafka_config: KafkaConfig) -> None:
    producer = RolloutProducer(plugins.instant, ProducerSettings(namespace="never-created"), kafka=kafka_config)
    with pytest.raises(RollstreamError, match="run 'rollstream topics create --namespace never-created'"):
        producer.run_sync(handle_signals=False)


def test_prompt_loading(kafka_config: KafkaConfig, bootstrap_servers: str, namespace_factory,
                        tmp_path: Path) -> None:
    names = namespace_factory(partitions=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "prompt": "1+1?"}\n{"id": "b", "prompt": "2+2?", "label": 4}\n{"id": "c"}\n')
    with pytest.raises(PromptFileError, match=r"bad.jsonl:3: missing 'prompt'"):
        load_prompts(bad, kafka_config, namespace=names.namespace)
    assert count(kafka_config, names.prompts) == 0  # nothing from the file was published

    good = tmp_path / "good.jsonl"
    good.write_text(bad.read_text().replace('{"id": "c"}', '{"id": "c", "prompt": [{"role": "user", '
                                                           '"content": "hi"}], "metadata": {"src": "x"}}'))
    result = run_cli(bootstrap_servers, "prompts", "load", str(good), "-N", names.namespace, "--epochs", "2")
    assert result.returncode == 0, result.stderr
    assert f"published 6 prompts (2 epochs) to {names.prompts}" in result.stdout
    assert sum(end_offsets(kafka_config, names.prompts).values()) == 6
    failed = run_cli(bootstrap_servers, "prompts", "load", str(bad), "-N", names.namespace)
    assert failed.returncode == 2 and "bad.jsonl:3" in failed.stderr
    assert count(kafka_config, names.prompts) == 6


def test_prompt_records_decode(kafka_config: KafkaConfig, namespace_factory) -> None:
    """What `prompts load` writes is what producers read: Prompt records keyed by id, one per epoch."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    names = namespace_factory(partitions=1)
    write_prompts(kafka_config, names, ["x", "y"])
    consumer = Consumer(kafka_config.consumer("decode-check"))
    consumer.assign([TopicPartition(names.prompts, 0, OFFSET_BEGINNING)])
    try:
        msgs = [m for m in (consumer.poll(5) for _ in range(2)) if m is not None]
    finally:
        consumer.close()
    prompts = [decode(m.value(), Prompt) for m in msgs]
    got = [(m.key(), p.id, p.epoch, p.label) for m, p in zip(msgs, prompts, strict=True)]
    assert got == [(b"x", "x", 0, "42"), (b"y", "y", 0, "42")]
