"""The local broker's TLS mode (``BrokerSpec(tls=True)``, ``rollstream broker start --tls [--sasl] [--mtls]``).

What it sets up, in ``data_dir/tls/`` (keys mode 0600), with ``openssl`` (nothing downloaded):

- A local CA (``ca.pem``, ``ca.key``; EC P-256, ten years), made once and kept: client files trust it, so a
  restart must not change it.
- A broker certificate signed by it (CN=broker), remade at each start, whose subjectAltName holds the
  broker's host, 127.0.0.1 and localhost: clients verify the hostname (librdkafka's
  ``ssl.endpoint.identification.algorithm=https``) and so do the brokers among themselves. The JVM reads it
  from ``broker.p12`` (PKCS12, a generated password in ``broker.p12.pass``).
- Every listener speaks TLS: clients and brokers ``SASL_SSL`` (with ``--sasl``) or ``SSL``, the KRaft
  controllers too, so nothing crosses even loopback in the clear.
- ``mtls=True``: the brokers require a client certificate (``ssl.client.auth=required``); one per
  principal (``<name>.pem``/``<name>.key``, CN=<name>) and ``ssl.principal.mapping.rules`` turning
  ``CN=producer`` into ``User:producer``, so the ACLs of ``rollstream acls`` apply to certificates as to
  SCRAM users. Without ``--sasl`` the StandardAuthorizer then runs too (super users ``admin`` and the
  brokers' own ``broker``). With ``--sasl`` the SASL user stays the principal.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

from rollstream.infra.broker._sasl import client_properties as sasl_client_properties
from rollstream.infra.broker._sasl import credentials
from rollstream.infra.broker._spec import BrokerError, BrokerSpec, hostport

TLS_DIR = "tls"
BROKER_NAME = "broker"  # the brokers' own certificate: their principal among themselves under mTLS
MAPPING_RULES = r"RULE:^CN=([A-Za-z0-9._-]+)$/$1/,DEFAULT"
_CA_DAYS, _LEAF_DAYS = 3650, 825
_OPENSSL_TIMEOUT_S = 20.0


def tls_dir(data_dir: Path) -> Path:
    return data_dir / TLS_DIR


def ensure_certificates(spec: BrokerSpec, principals: tuple[str, ...]) -> None:
    """Make the CA (once), the broker's certificate and keystore (each start) and, with ``spec.mtls``, a
    client certificate per principal (once), in ``data_dir/tls``. Blocks on ``openssl`` (~0.1 s a key).

    Raises:
        BrokerError: ``openssl`` is missing or failed (its message is in the error).
    """
    out = tls_dir(spec.data_dir)
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca, ca_key = out / "ca.pem", out / "ca.key"
    if not (ca.exists() and ca_key.exists()):
        _openssl("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc",
                 "-keyout", str(ca_key), "-out", str(ca), "-days", str(_CA_DAYS),
                 "-subj", "/CN=rollstream local CA")
        ca_key.chmod(0o600)
    hosts = {spec.host, "127.0.0.1", "::1", "localhost"}
    _leaf(out, BROKER_NAME, hosts)
    password = _broker_password(out)
    _openssl("pkcs12", "-export", "-in", str(out / f"{BROKER_NAME}.pem"), "-inkey", str(out / f"{BROKER_NAME}.key"),
             "-certfile", str(ca), "-name", BROKER_NAME, "-out", str(out / "broker.p12"),
             "-passout", f"pass:{password}")
    (out / "broker.p12").chmod(0o600)
    if spec.mtls:
        for name in principals:
            if not (out / f"{name}.pem").exists() or not (out / f"{name}.key").exists():
                _leaf(out, name, set())


def _leaf(out: Path, name: str, hosts: set[str]) -> None:
    """``name.pem``/``name.key`` signed by the CA; a subjectAltName for ``hosts`` (a server) when given."""
    key, csr, ext = out / f"{name}.key", out / f"{name}.csr", out / f"{name}.ext"
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-noenc", "-keyout", str(key),
             "-out", str(csr), "-subj", f"/CN={name}")
    key.chmod(0o600)
    lines = ["basicConstraints=critical,CA:FALSE", "keyUsage=critical,digitalSignature",
             f"extendedKeyUsage={'serverAuth,clientAuth' if hosts else 'clientAuth'}"]
    if hosts:
        lines.append("subjectAltName=" + ",".join(sorted(f"{'IP' if _is_ip(h) else 'DNS'}:{h}" for h in hosts)))
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(out / "ca.pem"), "-CAkey", str(out / "ca.key"),
             "-set_serial", str(secrets.randbits(63)), "-days", str(_LEAF_DAYS), "-extfile", str(ext),
             "-out", str(out / f"{name}.pem"))
    csr.unlink(missing_ok=True)
    ext.unlink(missing_ok=True)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _broker_password(out: Path) -> str:
    path = out / "broker.p12.pass"
    if path.exists():
        return path.read_text().strip()
    password = secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(password)
    return password


def _openssl(*args: str) -> None:
    try:
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=_OPENSSL_TIMEOUT_S,
                              check=False)
    except FileNotFoundError:
        raise BrokerError("--tls makes its certificates with openssl, which is not on PATH: install it "
                          "(apt-get install openssl) or start the broker without --tls") from None
    except subprocess.TimeoutExpired:
        raise BrokerError(f"openssl {args[0]} did not finish within {_OPENSSL_TIMEOUT_S:.0f} s",
                          retriable=True) from None
    if done.returncode != 0:
        raise BrokerError(f"openssl {args[0]} failed making the broker's TLS certificates: "
                          f"{done.stderr.strip()[-400:]}")


def server_properties(spec: BrokerSpec, security: dict[str, Any]) -> dict[str, Any]:
    """``security`` (the SASL mode's entries, or {}) turned to TLS: every listener encrypted, the keystore,
    the CA as truststore; with ``spec.mtls`` client certificates required and mapped to principals."""
    out = tls_dir(spec.data_dir)
    props = dict(security)
    if spec.sasl:
        props["listener.security.protocol.map"] = "CLIENT:SASL_SSL,CONTROLLER:SASL_SSL"
    else:
        props["listener.security.protocol.map"] = "CLIENT:SSL,CONTROLLER:SSL"
    props.update({
        "ssl.keystore.type": "PKCS12", "ssl.keystore.location": out / "broker.p12",
        "ssl.keystore.password": _broker_password(out), "ssl.key.password": _broker_password(out),
        "ssl.truststore.type": "PEM", "ssl.truststore.location": out / "ca.pem",
        "ssl.endpoint.identification.algorithm": "https",
        "ssl.client.auth": "required" if spec.mtls else "none",
    })
    if spec.mtls:
        props["ssl.principal.mapping.rules"] = MAPPING_RULES
        if not spec.sasl:  # the certificate is the principal: authorize by it
            props.update({"authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                          "allow.everyone.if.no.acl.found": "false",
                          "super.users": f"User:admin;User:{BROKER_NAME}"})
    return props


def listeners(spec: BrokerSpec, node: int) -> dict[str, Any]:
    """The named listeners (``CLIENT``, ``CONTROLLER``) of a TLS node without SASL (the SASL mode has its own)."""
    client, controller = spec.client_ports[node - 1], spec.controller_ports[node - 1]
    return {"listeners": f"CLIENT://{hostport(spec.host, client)},CONTROLLER://{hostport(spec.host, controller)}",
            "advertised.listeners": f"CLIENT://{hostport(spec.host, client)}", "inter.broker.listener.name": "CLIENT"}


def client_properties(data_dir: Path, principal: str, mtls: bool) -> dict[str, str]:
    """librdkafka's TLS settings for ``principal``: trust the local CA, verify the hostname, and under mTLS
    present ``principal``'s certificate. ``security.protocol`` is left to the caller (SSL or SASL_SSL)."""
    out = tls_dir(data_dir)
    props = {"ssl.ca.location": str(out / "ca.pem"), "ssl.endpoint.identification.algorithm": "https"}
    if mtls:
        props.update({"ssl.certificate.location": str(out / f"{principal}.pem"),
                      "ssl.key.location": str(out / f"{principal}.key")})
    return props


def client_settings(data_dir: Path, principal: str, *, sasl: bool, tls: bool, mtls: bool) -> dict[str, str]:
    """Every librdkafka setting ``principal`` needs for the broker of ``data_dir`` in this mode ({} for plaintext)."""
    props = sasl_client_properties(credentials(data_dir), principal) if sasl else {}
    if tls:
        props = {**props, "security.protocol": "SASL_SSL" if sasl else "SSL",
                 **client_properties(data_dir, principal, mtls)}
    return props
