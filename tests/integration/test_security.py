"""Security as a feature, against a real SASL/SCRAM broker with the StandardAuthorizer (no ACL = denied).

Pinned here:
- an unauthenticated client and a wrong password are refused with a one-line message that says so
  (never "cannot reach Kafka ... start one");
- the whole path works with credentials: topics (admin), `rollstream acls --apply`, prompts (admin),
  produce (producer principal), take / restart / audit / replay / export / report (trainer principal);
- the ACLs printed by `rollstream acls` are enough: a least-privilege trainer needs no group but its own
  (internal readers of manifests, replays, exports and reports use no group of their own);
- a producer principal cannot read NS.rollouts nor commit for the trainer's group, and an ACL denial says
  "not authorized" with the topic or group, never "does not exist".

The module starts its own broker (``broker start --sasl`` through the library) once, and stops it.
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer
from rollstream.consumers import RolloutConsumer, default_filters
from rollstream.infra import KafkaIOError, PolicyAnnouncer, TopicNames, announce_policy_version
from rollstream.infra.broker import BrokerSpec, client_config_files, free_ports, start_broker, stop_broker
from rollstream.infra.clients import open_consumer
from rollstream.infra.config import read_properties
from rollstream.infra.kafka_io import commit_offsets, read_ranges
from rollstream.schemas import PolicyVersion

from tests.integration._kafka import run_cli
from tests.integration._secure import grant_and_fill, one_line_error, secured_config, skip_without_scram

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sasl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Path]]]:
    skip_without_scram()
    data_dir = tmp_path_factory.mktemp("sasl-broker")
    port, controller = free_ports()
    spec = BrokerSpec(port=port, controller_port=controller, data_dir=data_dir, sasl=True, heap_mb=384)
    bootstrap = start_broker(spec, timeout=90.0)
    try:
        yield bootstrap, client_config_files(data_dir)
    finally:
        stop_broker(data_dir)


def test_client_files_and_modes(sasl_broker: tuple[str, dict[str, Path]]) -> None:
    _, files = sasl_broker
    assert sorted(files) == ["admin", "producer", "trainer"]
    for name, path in files.items():
        props = read_properties(path)
        assert props["security.protocol"] == "SASL_PLAINTEXT" and props["sasl.mechanism"] == "SCRAM-SHA-512"
        assert props["sasl.username"] == name and props["sasl.password"]
        assert path.stat().st_mode & 0o077 == 0  # readable by its owner only


def test_unauthenticated_and_wrong_password_refused(sasl_broker: tuple[str, dict[str, Path]],
                                                     tmp_path: Path) -> None:
    bootstrap, files = sasl_broker
    props = read_properties(files["trainer"])
    wrong = tmp_path / "wrong.properties"
    wrong.write_text("".join(f"{k}={'not-the-password' if k == 'sasl.password' else v}\n" for k, v in props.items()))
    line = one_line_error(run_cli(bootstrap, "topics", "describe", "--namespace", "sec-x", "--kafka-config",
                                  str(wrong), timeout_s=40))
    assert "authentication to Kafka" in line and "sasl.password" in line and "cannot reach" not in line

    plain = tmp_path / "plain.properties"
    plain.write_text("client.rack=none\n")
    line = one_line_error(run_cli(bootstrap, "lag", "--namespace", "sec-x", "--kafka-config", str(plain),
                                  timeout_s=40))
    assert "requires authentication" in line and "cannot reach" not in line


def test_least_privilege_roles_end_to_end(sasl_broker: tuple[str, dict[str, Path]], tmp_path: Path) -> None:
    bootstrap, files = sasl_broker
    ns, group = f"sec-{uuid.uuid4().hex[:6]}", f"trainer-{uuid.uuid4().hex[:6]}"
    admin, trainer = str(files["admin"]), str(files["trainer"])
    names = TopicNames(ns)

    created = run_cli(bootstrap, "topics", "create", "--namespace", ns, "--partitions", "2", "--kafka-config", admin)
    assert created.returncode == 0, created.stderr
    # Before any ACL: the trainer is told it is not authorized, not that the topic is missing.
    line = one_line_error(run_cli(bootstrap, "lag", "--namespace", ns, "--group", group, "--kafka-config", trainer))
    assert "not authorized for topic" in line and names.rollouts in line and "does not exist" not in line

    # A bare principal name ("producer") is taken as User:producer.
    grant_and_fill(bootstrap, files, ns, group, tmp_path, producer_principal="producer", prompts=6)

    config = secured_config(bootstrap, files["trainer"])
    filters = default_filters(dynamic_sampling=False)
    with RolloutConsumer(config=config, group_id=group, namespace=ns, filters=filters) as consumer:
        first = consumer.take(2, timeout=20)
    with PolicyAnnouncer(config, names) as run, RolloutConsumer(  # a restart, as a trainer run: commits in its
            config=config, group_id=group, namespace=ns, filters=filters, announcer=run) as consumer:  # transactions
        second = consumer.take(2, timeout=20)
        run.announce(PolicyVersion(version=2), timeout=15)
    assert second.step == first.step + 1
    announce_policy_version(config, names, PolicyVersion(version=1), timeout=15)  # a one-off run
    assert not {g.group_id for g in first.groups} & {g.group_id for g in second.groups}

    audited = run_cli(bootstrap, "audit", "--namespace", ns, "--group", group, "--kafka-config", trainer)
    assert audited.returncode == 0 and "OK" in audited.stdout, audited.stderr
    replayed = run_cli(bootstrap, "replay", "--step", str(first.step), "--namespace", ns, "--group", group,
                       "--kafka-config", trainer)
    assert replayed.returncode == 0, replayed.stderr
    assert [json.loads(line)["group_id"] for line in replayed.stdout.splitlines()] == [g.group_id for g in first.groups]
    if importlib.util.find_spec("pyarrow") is not None:  # export and report read as replay --step does
        exported = run_cli(bootstrap, "export", "--step", str(first.step), "--namespace", ns, "--group", group,
                           "--kafka-config", trainer, "--out", str(tmp_path / "step.parquet"))
        assert exported.returncode == 0 and (tmp_path / "step.parquet").exists(), exported.stderr
    reported = run_cli(bootstrap, "report", "--namespace", ns, "--group", group, "--kafka-config", trainer,
                       "--out", str(tmp_path / "run.html"))
    assert reported.returncode == 0 and (tmp_path / "run.html").exists(), reported.stderr

    _producer_is_denied(bootstrap, files, ns, group)


def _producer_is_denied(bootstrap: str, files: dict[str, Path], ns: str, group: str) -> None:
    names, config = TopicNames(ns), secured_config(bootstrap, files["producer"])
    with pytest.raises(KafkaIOError, match="not authorized") as denied:
        list(read_ranges(config, names.rollouts, {0: (0, 1)}, timeout=10))
    assert names.rollouts in str(denied.value)
    consumer: Consumer = open_consumer(config.consumer(group))
    try:
        with pytest.raises(KafkaIOError, match="GROUP_AUTHORIZATION_FAILED|not authorized"):
            commit_offsets(consumer, names.rollouts, {0: 1})
    finally:
        consumer.close()
    # A producer cannot take the producers over: trainer runs are the trainer's transactional id.
    with PolicyAnnouncer(config, names) as impostor, pytest.raises(KafkaIOError) as refused:
        impostor.announce(PolicyVersion(99), timeout=10)
    assert "not authorized" in str(refused.value).lower() or "authorization" in str(refused.value).lower()
    assert f"rollstream.{ns}.trainer-run" in str(refused.value)
    # The producer may read the trainer's lag (the lag gate) but not its manifests.
    assert run_cli(bootstrap, "lag", "--namespace", ns, "--group", group, "--kafka-config",
                   str(files["producer"])).returncode == 0
    line = one_line_error(run_cli(bootstrap, "audit", "--namespace", ns, "--group", group, "--kafka-config",
                                  str(files["producer"])))
    assert f"not authorized for topic {names.steps}" in line
