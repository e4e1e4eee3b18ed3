"""The local broker's security mode (``BrokerSpec(sasl=True)``, ``rollstream broker start --sasl``).

What it sets up:

- Clients and brokers talk on one ``SASL_PLAINTEXT`` listener (``CLIENT``) with SCRAM-SHA-512; brokers
  authenticate to each other there as ``admin``.
- The KRaft controller listener uses SASL PLAIN, one user (``admin``) defined in the JAAS line of
  ``server.properties``. Not SCRAM: SCRAM credentials live in the metadata log, which a controller must
  serve before it can read them (Kafka refuses SCRAM on controller listeners). Not PLAINTEXT either: its
  principal would be ANONYMOUS, which would then need to be a super user, and the controller port would
  accept any local process as one.
- ``org.apache.kafka.metadata.authorizer.StandardAuthorizer`` with ``allow.everyone.if.no.acl.found=false``;
  the only super user is ``User:admin``. Everyone else needs ACLs (``rollstream acls``).
- SCRAM credentials for ``admin``, ``producer`` and ``trainer``, added when storage is formatted
  (``StorageTool format --add-scram``), so they exist before the broker serves. Passwords are generated
  once and kept in ``credentials.json`` (mode 0600) in the data dir; a restart reuses them.
- One librdkafka client config per principal, ``<name>.properties`` (mode 0600) in the data dir, usable
  with every command's ``--kafka-config FILE``; rewritten at each start.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from rollstream.infra.broker._files import read_json
from rollstream.infra.broker._spec import BrokerError, BrokerSpec, hostport

PRINCIPALS = ("admin", "producer", "trainer")
MECHANISM = "SCRAM-SHA-512"
CREDENTIALS_FILE = "credentials.json"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
_SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"
_PLAIN_MODULE = "org.apache.kafka.common.security.plain.PlainLoginModule"


def credentials(data_dir: Path) -> dict[str, str]:
    """principal -> password from ``credentials.json``, created there (mode 0600) on first use.

    Raises:
        BrokerError: the file exists but lacks a principal's password (its storage was formatted with them).
    """
    path = data_dir / CREDENTIALS_FILE
    found = read_json(path)
    if found is None:
        made = {name: secrets.token_urlsafe(24) for name in PRINCIPALS}  # [A-Za-z0-9_-]: safe in JAAS quotes
        _write_private(path, json.dumps(made, indent=1))
        return made
    if not all(isinstance(found.get(name), str) and found[name] for name in PRINCIPALS):
        raise BrokerError(f"{path} lacks a password for one of {', '.join(PRINCIPALS)}; the broker's SCRAM users "
                          f"were created from it: restore it, or delete {data_dir} to start from scratch")
    return {name: str(found[name]) for name in PRINCIPALS}


def server_properties(spec: BrokerSpec, node: int, creds: dict[str, str]) -> dict[str, Any]:
    """The ``server.properties`` entries of the security mode for ``node`` (they replace the plaintext ones)."""
    client, controller = spec.client_ports[node - 1], spec.controller_ports[node - 1]
    admin = creds["admin"]
    return {
        "listeners": f"CLIENT://{hostport(spec.host, client)},CONTROLLER://{hostport(spec.host, controller)}",
        "advertised.listeners": f"CLIENT://{hostport(spec.host, client)}",
        "listener.security.protocol.map": "CLIENT:SASL_PLAINTEXT,CONTROLLER:SASL_PLAINTEXT",
        "inter.broker.listener.name": "CLIENT",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        "listener.name.client.scram-sha-512.sasl.jaas.config":
            f'{_SCRAM_MODULE} required username="admin" password="{admin}";',
        "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.controller.protocol": "PLAIN",
        "listener.name.controller.plain.sasl.jaas.config":
            f'{_PLAIN_MODULE} required username="admin" password="{admin}" user_admin="{admin}";',
        "authorizer.class.name": AUTHORIZER,
        "allow.everyone.if.no.acl.found": "false",
        "super.users": "User:admin",
    }


def format_args(creds: dict[str, str]) -> list[str]:
    """``StorageTool format`` arguments that create every principal's SCRAM credential."""
    return [arg for name in PRINCIPALS for arg in ("--add-scram", f"{MECHANISM}=[name={name},password={creds[name]}]")]


def client_properties(creds: dict[str, str], principal: str) -> dict[str, str]:
    """librdkafka settings that authenticate as ``principal``."""
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": MECHANISM, "sasl.username": principal,
            "sasl.password": creds[principal]}


def client_config_path(data_dir: Path, principal: str) -> Path:
    return data_dir / f"{principal}.properties"


def write_client_configs(data_dir: Path, settings: dict[str, dict[str, str]]) -> dict[str, Path]:
    """Write ``<principal>.properties`` (mode 0600) with each principal's ``settings``; principal -> path."""
    out = {}
    for name, props in settings.items():
        path = client_config_path(data_dir, name)
        _write_private(path, f"# librdkafka settings for principal User:{name}; pass with --kafka-config {path}\n"
                       + "".join(f"{k}={v}\n" for k, v in props.items()))
        out[name] = path
    return out


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, readable by its owner only from the first byte on."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
