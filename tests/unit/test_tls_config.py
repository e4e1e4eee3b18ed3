"""TLS without a broker: librdkafka's handshake failures map to one line naming the case and the fix; the TLS mode's
certificates (openssl), server.properties entries and client settings are what the contract names."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from rollstream.infra.broker import BrokerSpec
from rollstream.infra.broker._tls import client_settings, ensure_certificates, listeners, server_properties, tls_dir
from rollstream.infra.kafka_errors import plaintext_on_tls_error, tls_error
from rollstream.schemas import ConfigError

_PREFIX = "FAIL [rollstream#producer-1] [thrd:ssl://127.0.0.1:9093/bootstrap]: ssl://127.0.0.1:9093/bootstrap: "
LINES = {  # as librdkafka 2.x logs them (the first three seen against a real broker)
    "wrong_ca": "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate "
                "could not be verified, verify that ssl.ca.location is correctly configured or root CA certificates "
                "are installed (install ca-certificates package) (after 6ms in state SSL_HANDSHAKE)",
    "tls_on_plain": "SSL handshake failed: Disconnected: SSL connection closed by peer: connecting to a PLAINTEXT "
                    "broker listener? (after 4ms in state SSL_HANDSHAKE)",
    "no_client_cert": "Receive failed: error:0A000412:SSL routines::ssl/tls alert bad certificate: SSL alert number "
                      "42 (after 4ms in state APIVERSION_QUERY)",
    "expired": "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: certificate has expired",
    "mismatch": "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: Hostname mismatch",
}


@pytest.mark.parametrize(("case", "says", "fix"), [
    ("wrong_ca", "not signed by a CA this client trusts", "ssl.ca.location"),
    ("tls_on_plain", "this client speaks TLS but the port does not", "security.protocol=PLAINTEXT"),
    ("no_client_cert", "requires a client certificate", "ssl.certificate.location"),
    ("expired", "certificate has expired", "restart the broker"),
    ("mismatch", "does not name the host", "subjectAltName"),
])
def test_each_tls_failure_is_one_line_with_its_fix(case: str, says: str, fix: str) -> None:
    error = tls_error("127.0.0.1:9093", ["connected", _PREFIX + LINES[case]])
    assert error is not None and error.code == "_SSL" and not error.retriable
    text = str(error)
    assert "\n" not in text and "127.0.0.1:9093" in text and says in text and fix in text


def test_other_lines_are_no_tls_error() -> None:
    assert tls_error("b:1", ["Disconnected: connection closed by peer: receive 0 after POLLIN"]) is None
    plain = str(plaintext_on_tls_error("b:1", "SASL_PLAINTEXT"))
    assert "speaks TLS but this client does not" in plain and "security.protocol=SASL_SSL" in plain
    assert "ssl.ca.location" in plain


def test_mtls_needs_tls() -> None:
    with pytest.raises(ConfigError, match="mtls=True needs tls=True"):
        BrokerSpec(mtls=True)
    with pytest.raises(ConfigError, match="BrokerSpec.tls"):
        BrokerSpec(tls=1)  # type: ignore[arg-type]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_certificates_and_settings(tmp_path: Path) -> None:
    spec = BrokerSpec(port=19500, data_dir=tmp_path, tls=True, mtls=True)
    ensure_certificates(spec, ("admin", "producer"))
    out = tls_dir(tmp_path)
    ca_before = (out / "ca.pem").read_bytes()
    text = subprocess.run(["openssl", "x509", "-in", str(out / "broker.pem"), "-noout", "-text"], capture_output=True,
                          text=True, check=True).stdout
    assert "IP Address:127.0.0.1" in text and "DNS:localhost" in text  # hostname verification can pass
    for name in ("admin", "producer"):
        subject = subprocess.run(["openssl", "x509", "-in", str(out / f"{name}.pem"), "-noout", "-subject"],
                                 capture_output=True, text=True, check=True).stdout
        assert f"CN = {name}" in subject
        verified = subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.pem"), str(out / f"{name}.pem")],
                                  capture_output=True, text=True, check=False)
        assert verified.returncode == 0, verified.stderr
        assert (out / f"{name}.key").stat().st_mode & 0o077 == 0
    ensure_certificates(spec, ("admin", "producer"))  # a restart keeps the CA the client files trust
    assert (out / "ca.pem").read_bytes() == ca_before

    props = server_properties(spec, listeners(spec, 1))
    assert props["listener.security.protocol.map"] == "CLIENT:SSL,CONTROLLER:SSL"
    assert props["ssl.client.auth"] == "required" and "CN=" in props["ssl.principal.mapping.rules"]
    assert props["ssl.endpoint.identification.algorithm"] == "https" and "User:admin" in props["super.users"]
    settings = client_settings(tmp_path, "producer", sasl=False, tls=True, mtls=True)
    assert settings["security.protocol"] == "SSL" and settings["ssl.ca.location"] == str(out / "ca.pem")
    assert settings["ssl.certificate.location"].endswith("producer.pem")
    assert settings["ssl.key.location"].endswith("producer.key")
    assert client_settings(tmp_path, "producer", sasl=False, tls=False, mtls=False) == {}


def test_demo_tls_is_for_its_own_local_broker() -> None:
    from rollstream.demo import DemoError, DemoOptions

    assert DemoOptions(tls=True).tls
    with pytest.raises(DemoError, match="--kafka-config"):
        DemoOptions(tls=True, bootstrap_servers="kafka:9093")


def test_trainer_adapters_take_a_kafka_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from rollstream.consumers import slime
    from rollstream.consumers.trl import TRLWorkerSettings

    monkeypatch.delenv("ROLLSTREAM_KAFKA_CONFIG", raising=False)
    assert slime.SlimeSettings.from_args(SimpleNamespace()).kafka_config_file is None
    given = slime.SlimeSettings.from_args(SimpleNamespace(rollstream_kafka_config="/d/trainer.properties"))
    assert given.kafka_config_file == "/d/trainer.properties"
    monkeypatch.setenv("ROLLSTREAM_KAFKA_CONFIG", "/e/trainer.properties")
    assert slime.SlimeSettings.from_args(SimpleNamespace()).kafka_config_file == "/e/trainer.properties"
    assert TRLWorkerSettings(kafka_config_file="/d/trainer.properties").kafka_config_file == "/d/trainer.properties"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _serve_tls_once(cert: Path, key: Path) -> int:
    """A one-connection TLS server on a free loopback port (the handshake may fail: that is the point)."""
    import socket
    import ssl
    import threading

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            try:
                with context.wrap_socket(conn, server_side=True):
                    pass
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
@pytest.mark.parametrize(("days", "san", "says"), [
    ("-1", "IP:127.0.0.1", "the broker's certificate has expired"),
    ("1", "DNS:elsewhere.invalid", "does not name the host"),
    ("1", "IP:127.0.0.1", None),
])
def test_verify_failure_tells_expired_from_mismatched(tmp_path: Path, days: str, san: str, says: str | None) -> None:
    from rollstream.infra._tls_probe import speaks_tls, verify_failure

    ca, ca_key, cert, key = (tmp_path / n for n in ("ca.pem", "ca.key", "s.pem", "s.key"))
    _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc", "-keyout",
             str(ca_key), "-out", str(ca), "-days", "2", "-subj", "/CN=test CA")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc", "-keyout", str(key),
             "-out", str(tmp_path / "s.csr"), "-subj", "/CN=s")
    (tmp_path / "ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", str(tmp_path / "s.csr"), "-CA", str(ca), "-CAkey", str(ca_key), "-set_serial",
             "7", "-days", days, "-extfile", str(tmp_path / "ext"), "-out", str(cert))
    bootstrap = f"127.0.0.1:{_serve_tls_once(cert, key)}"
    reason = verify_failure(bootstrap, {"ssl.ca.location": str(ca)})
    if says is None:
        assert reason is None
        assert speaks_tls(f"127.0.0.1:{_serve_tls_once(cert, key)}")
        return
    librdkafka = "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: broker certificate"
    error = tls_error(bootstrap, [librdkafka, str(reason)])
    assert error is not None and says in str(error)
