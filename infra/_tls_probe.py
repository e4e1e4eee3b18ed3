"""Two TLS handshakes of Python's own ``ssl`` module that tell apart what librdkafka reports alike: whether a port
speaks TLS at all (a plaintext client sees only "connection closed"), and why the broker's certificate failed
verification (librdkafka says "certificate verify failed" for a wrong CA, an expired certificate and a hostname
mismatch alike; OpenSSL's verify result names which). Each blocks about a second at most; neither sends data.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping

_TIMEOUT_S = 1.0


def _first_address(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip().split("://")[-1]
    host, _, port = first.rpartition(":")
    return host.strip("[]"), int(port)


def speaks_tls(bootstrap: str) -> bool:
    """Whether the first bootstrap address completes a TLS handshake (its certificate unchecked); False when
    it does not or cannot tell."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only "is it TLS": nothing is sent
    try:
        host, port = _first_address(bootstrap)
        with socket.create_connection((host, port), timeout=_TIMEOUT_S) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


def verify_failure(bootstrap: str, settings: Mapping[str, object]) -> str | None:
    """OpenSSL's reason the first bootstrap address's certificate fails verification under the client
    ``settings`` (``ssl.ca.location``, ``ssl.endpoint.identification.algorithm``), such as "certificate has
    expired" or "Hostname mismatch, ..."; None when it verifies or the handshake fails otherwise."""
    try:
        ca = settings.get("ssl.ca.location")
        context = ssl.create_default_context(cafile=str(ca) if ca else None)
        context.check_hostname = str(settings.get("ssl.endpoint.identification.algorithm", "https")).lower() != "none"
        host, port = _first_address(bootstrap)
        with socket.create_connection((host, port), timeout=_TIMEOUT_S) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        return str(exc.verify_message)
    except (OSError, ValueError):
        return None
