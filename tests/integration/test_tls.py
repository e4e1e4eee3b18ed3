"""Encrypted end to end, against real brokers started with ``--tls`` (issue 28).

Pinned here:
- ``--tls --sasl``: the client files speak SASL_SSL and trust the local CA (``ssl.ca.location``, hostname checked);
  produce (producer principal) -> take (trainer principal) -> audit works with least-privilege ACLs over it;
- a wrong CA and a plaintext client against the TLS port each fail with one line naming the case and the fix
  (never "cannot reach");
- ``--mtls``: the principal comes from the client certificate (CN=producer -> User:producer), the ACLs apply to
  it, and a client without a certificate is told it needs one.

Each test module's brokers are private (free ports, a temp data dir) and stopped at the end.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, default_filters
from rollstream.infra import KafkaIOError, TopicNames
from rollstream.infra.broker import (
    BrokerSpec,
    broker_status,
    client_config_files,
    free_ports,
    start_broker,
    stop_broker,
)
from rollstream.infra.config import read_properties
from rollstream.infra.kafka_io import read_ranges

from tests.integration._kafka import REPO_ROOT, run_cli
from tests.integration._secure import grant_and_fill, one_line_error, secured_config, skip_without_scram

pytestmark = pytest.mark.integration


def _start(data_dir: Path, *, sasl: bool, mtls: bool) -> str:
    port, controller = free_ports()
    spec = BrokerSpec(port=port, controller_port=controller, data_dir=data_dir, sasl=sasl, tls=True, mtls=mtls,
                      heap_mb=384)
    return start_broker(spec, timeout=90.0)


@pytest.fixture(scope="module")
def sasl_ssl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Path]]]:
    skip_without_scram()
    data_dir = tmp_path_factory.mktemp("sasl-ssl-broker")
    bootstrap = _start(data_dir, sasl=True, mtls=False)
    try:
        yield bootstrap, client_config_files(data_dir)
    finally:
        stop_broker(data_dir)


def _setup_namespace(bootstrap: str, files: dict[str, Path], ns: str, group: str, tmp_path: Path) -> None:
    """topics (admin), the least-privilege ACLs (admin), prompts (admin), rollouts (producer principal)."""
    created = run_cli(bootstrap, "topics", "create", "--namespace", ns, "--partitions", "2", "--kafka-config",
                      str(files["admin"]))
    assert created.returncode == 0, created.stderr
    grant_and_fill(bootstrap, files, ns, group, tmp_path, producer_principal="User:producer", prompts=4)


def test_sasl_ssl_files_and_least_privilege_end_to_end(sasl_ssl_broker: tuple[str, dict[str, Path]],
                                                       tmp_path: Path) -> None:
    bootstrap, files = sasl_ssl_broker
    assert sorted(files) == ["admin", "producer", "trainer"]
    for name, path in files.items():
        props = read_properties(path)
        assert props["security.protocol"] == "SASL_SSL" and props["sasl.username"] == name
        assert Path(props["ssl.ca.location"]).is_file() and props["ssl.endpoint.identification.algorithm"] == "https"
        assert path.stat().st_mode & 0o077 == 0
    assert broker_status(files["admin"].parent).tls

    ns, group = f"tls-{uuid.uuid4().hex[:6]}", f"trainer-{uuid.uuid4().hex[:6]}"
    _setup_namespace(bootstrap, files, ns, group, tmp_path)
    config = secured_config(bootstrap, files["trainer"])
    with RolloutConsumer(config=config, group_id=group, namespace=ns,
                         filters=default_filters(dynamic_sampling=False)) as consumer:
        batch = consumer.take(2, timeout=20)
    assert len(batch.groups) == 2
    audited = run_cli(bootstrap, "audit", "--namespace", ns, "--group", group, "--kafka-config", str(files["trainer"]))
    assert audited.returncode == 0 and "OK" in audited.stdout, audited.stderr


def test_wrong_ca_and_plaintext_client_say_so(sasl_ssl_broker: tuple[str, dict[str, Path]], tmp_path: Path) -> None:
    bootstrap, files = sasl_ssl_broker
    props = read_properties(files["trainer"])
    other_ca = tmp_path / "other-ca.pem"  # a CA that did not sign the broker's certificate
    subprocess.run(["openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-noenc", "-keyout", str(tmp_path / "other-ca.key"), "-out", str(other_ca), "-days", "1",
                    "-subj", "/CN=another CA"], check=True, capture_output=True)
    wrong = tmp_path / "wrong-ca.properties"
    wrong.write_text("".join(f"{k}={other_ca if k == 'ssl.ca.location' else v}\n" for k, v in props.items()))
    line = one_line_error(run_cli(bootstrap, "lag", "--namespace", "tls-x", "--kafka-config", str(wrong),
                                  timeout_s=40))
    assert "not signed by a CA this client trusts" in line and "ssl.ca.location" in line and "cannot reach" not in line

    plain = tmp_path / "plain.properties"
    plain.write_text("".join(f"{k}={'SASL_PLAINTEXT' if k == 'security.protocol' else v}\n"
                             for k, v in props.items() if not k.startswith("ssl.")))
    line = one_line_error(run_cli(bootstrap, "lag", "--namespace", "tls-x", "--kafka-config", str(plain),
                                  timeout_s=40))
    assert "speaks TLS but this client does not" in line and "security.protocol=SASL_SSL" in line
    assert "cannot reach" not in line


def test_mutual_tls_principal_from_certificate(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    data_dir = tmp_path_factory.mktemp("mtls-broker")
    bootstrap = _start(data_dir, sasl=False, mtls=True)
    try:
        files = client_config_files(data_dir)
        props = read_properties(files["producer"])
        assert props["security.protocol"] == "SSL" and "sasl.username" not in props
        assert Path(props["ssl.certificate.location"]).is_file() and Path(props["ssl.key.location"]).is_file()
        ns, group = f"mtls-{uuid.uuid4().hex[:6]}", f"trainer-{uuid.uuid4().hex[:6]}"
        _setup_namespace(bootstrap, files, ns, group, tmp_path)  # ACLs on User:producer / User:trainer
        audited = run_cli(bootstrap, "audit", "--namespace", ns, "--group", group, "--kafka-config",
                          str(files["trainer"]))
        assert audited.returncode == 0, audited.stderr
        with pytest.raises(KafkaIOError, match="not authorized"):  # User:producer, from its certificate
            list(read_ranges(secured_config(bootstrap, files["producer"]), TopicNames(ns).rollouts, {0: (0, 1)},
                             timeout=10))

        no_cert = tmp_path / "no-cert.properties"
        no_cert.write_text("".join(f"{k}={v}\n" for k, v in props.items() if k not in (
            "ssl.certificate.location", "ssl.key.location")))
        line = one_line_error(run_cli(bootstrap, "lag", "--namespace", ns, "--kafka-config", str(no_cert),
                                      timeout_s=40))
        assert "requires a client certificate" in line and "ssl.certificate.location" in line
    finally:
        stop_broker(data_dir)


@pytest.mark.slow
def test_demo_over_tls(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out = tmp_path / "demo"
    # The environment's broker is ignored: --tls starts the demo's own, and every client trusts its CA.
    done = run_cli("127.0.0.1:1", "demo", "--tls", "--steps", "2", "--groups-per-step", "2", "--out", str(out),
                   timeout_s=240)
    assert done.returncode == 0 and "rollstream demo passed" in done.stdout, done.stderr[-3000:]
    assert "(TLS)" in done.stderr + done.stdout
    assert not (out / "broker").exists()  # the broker it started was stopped and removed


@pytest.mark.slow
def test_chaos_nemesis_over_tls(tmp_path: Path) -> None:
    report = tmp_path / "chaos-tls.md"
    done = subprocess.run([sys.executable, "-m", "tests.chaos", "--tls", "--seconds", "12", "--seed", "7",
                           "--take-n", "8", "--report", str(report)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=280, check=False)
    assert done.returncode == 0 and "chaos PASS" in done.stdout, (done.stdout + done.stderr)[-4000:]
    text = report.read_text()
    assert "--tls" in text  # the repeat command keeps the mode
    assert "SIGKILL producer" in text and "SIGSTOP producer" in text, text  # seed 7's first 12 s: a kill, a stop
