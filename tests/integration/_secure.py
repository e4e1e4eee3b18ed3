"""Helpers of the tests against private secured brokers (test_security.py: SASL; test_tls.py: TLS, mTLS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollstream.infra import KafkaConfig
from rollstream.infra.broker import default_kafka_version
from rollstream.infra.broker._spec import SASL_KAFKA, kafka_release
from rollstream.infra.config import read_properties

from tests.integration._kafka import run_cli


def skip_without_scram() -> None:
    """Skip, saying why, when the Kafka the tests run (``ROLLSTREAM_KAFKA_VERSION``, as ``make compat`` sets
    it) cannot create SCRAM users in KRaft mode: before 3.5, where ``BrokerSpec(sasl=True)`` is refused."""
    version = default_kafka_version()
    if kafka_release(version)[:2] < SASL_KAFKA:
        pytest.skip(f"Kafka {version} has no SCRAM users in KRaft mode (3.5 and newer do): no SASL broker")


def secured_config(bootstrap: str, path: Path) -> KafkaConfig:
    """The client configuration of one of the broker's client files (admin, producer, trainer)."""
    return KafkaConfig(bootstrap_servers=bootstrap, extra=read_properties(path))


def one_line_error(result: object) -> str:
    """The one ``error:`` line of a CLI run that failed with exit status 2 (asserted)."""
    stderr = getattr(result, "stderr", "")
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert getattr(result, "returncode", 0) == 2 and len(lines) == 1, stderr
    return lines[0]


def grant_and_fill(bootstrap: str, files: dict[str, Path], ns: str, group: str, tmp_path: Path, *,
                   producer_principal: str, prompts: int) -> None:
    """On `ns`, whose topics exist: the least-privilege ACLs (admin) for `producer_principal` and User:trainer
    in `group`, `prompts` prompts (admin), and their rollouts produced (the producer principal); asserted."""
    admin, producer = str(files["admin"]), str(files["producer"])
    applied = run_cli(bootstrap, "acls", "--namespace", ns, "--producer-principal", producer_principal,
                      "--trainer-principal", "User:trainer", "--trainer-group", group, "--apply",
                      "--kafka-config", admin)
    assert applied.returncode == 0 and "applied" in applied.stdout, applied.stderr
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"q {i}", "label": "4"}) + "\n"
                            for i in range(prompts)))
    loaded = run_cli(bootstrap, "prompts", "load", str(path), "--namespace", ns, "--kafka-config", admin)
    assert loaded.returncode == 0, loaded.stderr
    produced = run_cli(bootstrap, "produce", "--namespace", ns, "--generate", "tests.plugins:instant",
                       "--reward", "tests.plugins:reward", "--trainer-group", group, "--exit-when-idle", "1",
                       "--kafka-config", producer, timeout_s=60)
    assert produced.returncode == 0, produced.stderr
