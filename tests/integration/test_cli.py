"""The public CLI contract against real processes: broker start/status/stop (default or --controller-port; a
taken port or a bad --controller-port is one clear line naming the flag), topics create/describe, and a
--kafka-config file that reaches every client (a property librdkafka refuses is a clear error, not a crash)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from rollstream.infra.broker import CONTROLLER_PORT_OFFSET, free_port, free_ports

REPO = Path(__file__).resolve().parents[2]


def rollstream(*args: str, timeout: float = 180, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollstream", *args], cwd=REPO, text=True, capture_output=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


@pytest.mark.parametrize("custom", [False, True], ids=["default-controller-port", "custom-controller-port"])
def test_broker_start_status_stop(tmp_path: Path, custom: bool) -> None:
    data_dir = str(tmp_path / "broker")
    port, controller = free_ports() if custom else (free_port(), None)
    flags = ["--controller-port", str(controller)] if custom else []
    started = rollstream("broker", "start", "--port", str(port), *flags, "--data-dir", data_dir, "--heap-mb", "384")
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"  # the last line is the address
        status = rollstream("broker", "status", "--data-dir", data_dir)
        assert status.returncode == 0 and f"127.0.0.1:{port}" in status.stdout
        assert f"controller ports {controller if custom else port + CONTROLLER_PORT_OFFSET};" in status.stdout
    finally:
        stopped = rollstream("broker", "stop", "--data-dir", data_dir)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    after = rollstream("broker", "status", "--data-dir", data_dir)
    assert after.returncode == 1 and "not running" in after.stdout


@pytest.mark.parametrize("which", ["client", "controller"])
def test_broker_start_on_a_taken_port_is_one_line_naming_the_flag(tmp_path: Path, which: str) -> None:
    port, controller = free_ports()
    taken, flag = (port, "--port") if which == "client" else (controller, "--controller-port")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        started = rollstream("broker", "start", "--port", str(port), "--controller-port", str(controller),
                             "--data-dir", str(tmp_path / "broker"), timeout=60)
    assert started.returncode == 2, started.stdout + started.stderr
    lines = started.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {which} port {taken} on 127.0.0.1 is already in use")
    assert f"choose another {flag} " in lines[0]
    assert rollstream("broker", "status", "--data-dir", str(tmp_path / "broker")).returncode == 1


def test_broker_start_rejects_overlapping_controller_ports_by_flag(tmp_path: Path) -> None:
    started = rollstream("broker", "start", "--port", "39000", "--nodes", "3", "--controller-port", "39002",
                         "--data-dir", str(tmp_path / "broker"), timeout=60)
    assert started.returncode == 2 and "Traceback" not in started.stderr, started.stderr
    assert "--controller-port" in started.stderr and "overlap the client ports 39000-39002" in started.stderr


def test_topics_create_is_idempotent_and_describes_the_plan(bootstrap_servers: str) -> None:
    namespace = f"cli-{uuid.uuid4().hex[:8]}"
    first = rollstream("topics", "create", "--namespace", namespace, "--partitions", "2", "--retention-days", "2")
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(": created") == 5 and f"{namespace}.inflight: created" in first.stdout
    again = rollstream("topics", "create", "--namespace", namespace)
    assert again.returncode == 0 and again.stdout.count(": exists") == 5
    described = rollstream("topics", "describe", "--namespace", namespace)
    assert described.returncode == 0, described.stderr
    assert f"retention.ms={2 * 24 * 3600 * 1000}" in described.stdout
    assert "cleanup.policy=compact" in described.stdout and f"{namespace}.inflight " in described.stdout


@pytest.mark.parametrize("command", [("topics", "create"), ("lag",), ("take", "-n", "1", "--timeout", "1"),
                                     ("replay", "--since", "1m")])
def test_kafka_config_file_reaches_the_clients(bootstrap_servers: str, tmp_path: Path, command: tuple[str, ...]
                                               ) -> None:
    props = tmp_path / "client.properties"
    props.write_text("# a property librdkafka does not know: every client must refuse it\nbogus.property=1\n")
    result = rollstream(*command, "--namespace", "rollstream-cli-config", "--kafka-config", str(props), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'No such configuration property: "bogus.property"' in result.stderr
    assert "Traceback" not in result.stderr


def test_every_command_fails_fast_and_quietly_against_an_unreachable_broker(tmp_path: Path) -> None:
    """One line naming the address and the fix, within ~15 s, and none of librdkafka's hundreds of
    connection lines (they took 30-60 s and flooded the terminal)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "x"}\n')
    commands = [["topics", "create"], ["topics", "describe"], ["lag"], ["audit"], ["replay", "--step", "0"],
                ["take", "-n", "1"], ["prompts", "load", str(prompts)],
                ["produce", "--generate", "tests.plugins:instant", "--startup-timeout", "15"]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "ROLLSTREAM_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}"}
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "rollstream", *args], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in commands]
    results = [(args, p.returncode, out, err) for args, p in zip(commands, procs, strict=True)
               for out, err in [p.communicate(timeout=120)]]
    assert time.monotonic() - started < 45  # all in parallel, each bounded at ~15 s
    for args, code, out, err in results:
        lines = [line for line in (out + err).splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (args, code, lines[:5])
        assert lines[0].startswith("error: cannot reach Kafka at 127.0.0.1:") and "rollstream broker start" in lines[0]
