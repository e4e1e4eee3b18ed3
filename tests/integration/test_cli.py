"""The public CLI contract against real processes: broker start/status/stop, topics create/describe, and a
--kafka-config file that reaches every client (a property librdkafka refuses is a clear error, not a crash)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from infra.broker import free_port

REPO = Path(__file__).resolve().parents[2]


def rollstream(*args: str, timeout: float = 180, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollstream", *args], cwd=REPO, text=True, capture_output=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_broker_start_status_stop(tmp_path: Path) -> None:
    data_dir, port = str(tmp_path / "broker"), free_port()
    started = rollstream("broker", "start", "--port", str(port), "--data-dir", data_dir, "--heap-mb", "384")
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"  # the last line is the address
        status = rollstream("broker", "status", "--data-dir", data_dir)
        assert status.returncode == 0 and f"127.0.0.1:{port}" in status.stdout
    finally:
        stopped = rollstream("broker", "stop", "--data-dir", data_dir)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    after = rollstream("broker", "status", "--data-dir", data_dir)
    assert after.returncode == 1 and "not running" in after.stdout


def test_topics_create_is_idempotent_and_describes_the_plan(bootstrap_servers: str) -> None:
    namespace = f"cli-{uuid.uuid4().hex[:8]}"
    first = rollstream("topics", "create", "--namespace", namespace, "--partitions", "2", "--retention-days", "2")
    assert first.returncode == 0, first.stderr
    assert first.stdout.count(": created") == 4
    again = rollstream("topics", "create", "--namespace", namespace)
    assert again.returncode == 0 and again.stdout.count(": exists") == 4
    described = rollstream("topics", "describe", "--namespace", namespace)
    assert described.returncode == 0, described.stderr
    assert f"retention.ms={2 * 24 * 3600 * 1000}" in described.stdout
    assert "cleanup.policy=compact" in described.stdout


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
