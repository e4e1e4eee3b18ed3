"""The five most common first-day mistakes, each made through the CLI against the real broker: each ends in one
line that names the fix, exit status 2 (a producer, which waits by design, logs one warning line), within its
bound. No traceback.

a. no broker at the bootstrap address; b. a misspelt namespace; c. no prompts loaded; d. producers gating on
another trainer group than the trainer's; e. a topic too small for a group. And f.: a take without --timeout that
waits on an empty namespace is not silent: its waiting lines name the cause, and Ctrl-C stops it (130).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

from rollstream.infra import KafkaConfig, TopicNames

from rollstream.cli._waiting import NOTICES_ENV
from tests.conftest import NamespaceFactory, free_port
from tests.integration._kafka import count, run_cli, start_cli, until, write_prompts

_BOUND_S = 15.0  # a command's one-line error comes within this much of its own timeout
_PRODUCE = ("produce", "--generate", "tests.plugins:instant", "--reward", "tests.plugins:alternating",
            "--concurrency", "1")


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The only line the command printed (stdout and stderr), asserting exit status 2 and no traceback."""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, lines[:8])
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def timed(bootstrap: str, *args: str, timeout_s: float = 60.0) -> tuple[str, float]:
    started = time.monotonic()
    line = one_line(run_cli(bootstrap, *args, timeout_s=timeout_s))
    return line, time.monotonic() - started


def stopped_log(producer: subprocess.Popen[str]) -> str:
    """A producer's stderr once SIGTERM stopped it."""
    producer.terminate()
    _, err = producer.communicate(timeout=60)
    return err


def test_a_no_broker_names_the_address_and_how_to_start_or_point_at_one() -> None:
    address = f"127.0.0.1:{free_port()}"
    line, took = timed(address, "status", "--namespace", "demo")
    assert f"cannot reach Kafka at {address}" in line and "rollstream broker start" in line
    assert "ROLLSTREAM_BOOTSTRAP_SERVERS / --bootstrap-servers" in line and took < _BOUND_S


def test_b_wrong_namespace_lists_the_namespaces_that_exist(bootstrap_servers: str, namespace: TopicNames) -> None:
    typo = namespace.namespace[:-1] + "x"
    for command in (("take", "-n", "1"), ("status",), ("topics", "alter", "--max-message-mib", "2")):
        line, took = timed(bootstrap_servers, *command, "--namespace", typo)
        assert f"namespace {typo} has no topics" in line and f"did you mean --namespace {namespace.namespace}" in line
        assert f"rollstream topics create --namespace {typo}" in line and took < _BOUND_S


def test_c_no_prompts_loaded_names_prompts_load(bootstrap_servers: str, namespace: TopicNames) -> None:
    ns = namespace.namespace
    producer = run_cli(bootstrap_servers, *_PRODUCE, "--namespace", ns, "--exit-when-idle", "2", timeout_s=60)
    assert producer.returncode == 0, producer.stderr[-2000:]
    warned = [line for line in producer.stderr.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and f"{ns}.prompts is empty" in warned[0], producer.stderr[-2000:]
    assert f"'rollstream prompts load FILE.jsonl --namespace {ns}'" in warned[0]
    line, took = timed(bootstrap_servers, "take", "-n", "1", "--timeout", "6", "--namespace", ns)
    assert "take timed out after 6 s with 0 of 1 groups" in line
    assert f"{ns}.prompts is empty: load prompts with 'rollstream prompts load FILE.jsonl --namespace {ns}'" in line
    assert took < 6 + _BOUND_S


def test_d_trainer_group_mismatch_names_both_groups_and_the_flags(
        bootstrap_servers: str, kafka_config: KafkaConfig, namespace_factory: NamespaceFactory, tmp_path: Path) -> None:
    names = namespace_factory(partitions=1)
    followed, trainer = f"follows-{uuid.uuid4().hex[:6]}", f"trains-{uuid.uuid4().hex[:6]}"
    write_prompts(kafka_config, names, [f"p{i}" for i in range(12)])
    producer = start_cli(bootstrap_servers, *_PRODUCE, "--namespace", names.namespace, "--max-lag", "2",
                         "--trainer-group", followed)
    try:
        until(lambda: count(kafka_config, names.rollouts) >= 3, 60, "the producer to reach its max lag")
        line, took = timed(bootstrap_servers, "take", "-n", "2", "--steps", "3", "--timeout", "10", "--group",
                           trainer, "--namespace", names.namespace, "--out", str(tmp_path / "steps.jsonl"))
    finally:
        log = stopped_log(producer)
    assert "1 step committed before" in line and "trainer group mismatch" in line, line
    assert f"gate on trainer group {followed}, but this trainer commits as {trainer}" in line
    assert f"--trainer-group {trainer}" in line and f"--group {followed}" in line and took < 10 + _BOUND_S
    warned = [row for row in log.splitlines() if "trainer group mismatch" in row]
    assert len(warned) == 1 and f"gates on trainer group {followed}" in warned[0], log[-3000:]
    assert f"trainer group {trainer} commits there" in warned[0] and f"--trainer-group {trainer}" in warned[0]


def test_e_topic_too_small_for_a_group_says_size_limit_and_both_fixes(
        bootstrap_servers: str, kafka_config: KafkaConfig, namespace_factory: NamespaceFactory) -> None:
    names = namespace_factory(partitions=1, max_message_bytes=8192)
    write_prompts(kafka_config, names, ["p0", "p1"])
    producer = run_cli(bootstrap_servers, *_PRODUCE, "--n-samples", "512", "--max-lag", "100",
                       "--namespace", names.namespace, "--exit-when-idle", "2", timeout_s=60)
    assert producer.returncode == 0, producer.stderr[-2000:]
    warned = [row for row in producer.stderr.splitlines() if "exceeds max_message_bytes=8192" in row]
    assert len(warned) == 2, producer.stderr[-3000:]
    line, took = timed(bootstrap_servers, "take", "-n", "1", "--timeout", "6", "--namespace", names.namespace)
    assert "the last 2 groups looked at were all filtered: failed 2" in line, line
    for text in (warned[0], line):
        assert "group record of" in text and f"max.message.bytes of {names.rollouts}" in text
        assert f"'rollstream topics alter --namespace {names.namespace} --max-message-mib " in text
        assert "--n-samples" in text
    assert took < 6 + _BOUND_S
    # The fix it names works: alter the topics (idempotent), restart the producer, and a group as big is published.
    found = re.search(r"--max-message-mib (\d+)'", warned[0])
    assert found is not None, warned[0]
    mib = found.group(1)
    for i, expected in enumerate((f"{names.rollouts}: max.message.bytes 8192 -> {int(mib) << 20}",
                                  f"{names.namespace}: unchanged (every value already set)")):
        altered = run_cli(bootstrap_servers, "topics", "alter", "--namespace", names.namespace, "--max-message-mib",
                          mib, timeout_s=60)
        assert altered.returncode == 0 and expected in altered.stdout.splitlines(), (i, altered.stdout, altered.stderr)
    described = run_cli(bootstrap_servers, "topics", "describe", "--namespace", names.namespace, timeout_s=60)
    row = next(x for x in described.stdout.splitlines() if x.startswith(names.rollouts + " "))
    assert f"max.message.bytes={int(mib) << 20}" in row, described.stdout
    write_prompts(kafka_config, names, ["p2", "p3"])
    producer = run_cli(bootstrap_servers, *_PRODUCE, "--n-samples", "512", "--max-lag", "100",
                       "--namespace", names.namespace, "--exit-when-idle", "2", timeout_s=60)
    assert producer.returncode == 0 and "exceeds max_message_bytes" not in producer.stderr, producer.stderr[-2000:]
    taken = run_cli(bootstrap_servers, "take", "-n", "2", "--timeout", "20", "--namespace", names.namespace,
                    timeout_s=60)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert sorted(json.loads(x)["prompt_id"] for x in taken.stdout.splitlines()) == ["p2", "p3"]


def test_f_a_take_that_waits_says_how_long_how_many_and_why(bootstrap_servers: str, namespace: TopicNames) -> None:
    ns = namespace.namespace
    take = start_cli(bootstrap_servers, "take", "-n", "2", "--namespace", ns, **{NOTICES_ENV: "1,2"})
    lines: list[str] = []

    def read() -> None:
        for line in take.stderr or ():
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        first = until(lambda: next((x for x in list(lines) if x.startswith("take waiting for")), None), 60,
                      "the first waiting line")
        shown = time.monotonic()
        why = until(lambda: next((x for x in list(lines) if f"{ns}.prompts is empty" in x), None), 30,
                    "a waiting line naming the cause")
        assert time.monotonic() - shown < 15, lines
    finally:
        sent = time.monotonic()
        take.send_signal(signal.SIGINT)
        code = take.wait(timeout=30)
        reader.join(timeout=10)
    assert code == 130 and time.monotonic() - sent < _BOUND_S, (code, lines[-5:])
    assert "0 of 2 groups so far (step not taken yet; 0 committed before; Ctrl-C stops" in first, first
    assert why.startswith("take waiting for") and "0 of 2 groups so far" in why
    assert f"load prompts with 'rollstream prompts load FILE.jsonl --namespace {ns}'" in why
    assert f"0 producers in {ns}.producers" in why and "this take looked at no group (none arrived)" in why, why
    assert lines[-1] == "interrupted (SIGINT) after 0 committed step(s)", lines
    assert not any("Traceback" in x for x in lines), lines
