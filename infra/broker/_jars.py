"""The Kafka jars and the Java runtime the local broker needs.

The jars are resolved once per Kafka version by Maven from ``infra/kafka/pom.xml`` (its ``kafka.version``
overridden with ``-Dkafka.version`` for another release) into a cache, a directory per version, marked complete
with the hash of the pom as resolved for that version (its ``kafka.version`` set to it), so a changed pom resolves
again and an unchanged one never touches the network. That hash depends on nothing but the jars' pom: checkouts
of other rollstream versions that share the cache and pin that version with the same dependencies agree on it,
and never re-resolve (delete and fetch again) a version directory another one's broker may be running from.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from rollstream.infra.broker._files import TAIL_LINES, locked, read_text
from rollstream.infra.broker._spec import POM, BrokerError, default_kafka_version, kafka_release

log = logging.getLogger(__name__)

_MVN_TIMEOUT = 900.0  # first resolution downloads ~60 MB from Maven Central


def ensure_kafka_jars(cache_dir: Path | None = None, *, version: str | None = None,
                      progress: Callable[[str], None] | None = None) -> Path:
    """Resolve the Kafka jars of ``version`` with Maven once and return the directory holding them.

    ``version`` defaults to ``$ROLLSTREAM_KAFKA_VERSION``, else the one pinned in ``infra/kafka/pom.xml``.
    Blocks: not at all when cached (a marker holds the hash of the pom as resolved for ``version``); else for
    the Maven run, up to 15 minutes. Thread- and process-safe (a file lock). ``cache_dir`` defaults to
    ``$ROLLSTREAM_CACHE_DIR`` or ``~/.cache/rollstream``; jars land in ``<cache>/kafka-<version>/libs``.
    ``progress`` is called with one human sentence before a resolution starts.

    Raises:
        ConfigError: ``version`` is not ``MAJOR.MINOR.PATCH``.
        BrokerError: ``mvn`` or ``java`` is missing, or Maven failed (the tail of its output; an unknown
            version fails here).
    """
    version = version or default_kafka_version()
    kafka_release(version)  # a malformed version is named here, before Maven is asked for it
    pom = _pom_for(version)
    env_cache = os.environ.get("ROLLSTREAM_CACHE_DIR")
    cache = Path(cache_dir or env_cache or Path.home() / ".cache" / "rollstream").expanduser()
    root = cache / f"kafka-{version}"
    libs, marker = root / "libs", root / "complete"
    digest = hashlib.sha256(pom).hexdigest()
    if read_text(marker) == digest:
        return libs
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("Maven (`mvn`) is not on PATH; it resolves the Kafka jars once. Install it "
                          "(e.g. `apt-get install maven`) or point ROLLSTREAM_BOOTSTRAP_SERVERS at a cluster.")
    find_java()
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / ".lock", _MVN_TIMEOUT):
        if read_text(marker) == digest:
            return libs
        message = f"resolving Apache Kafka {version} jars with Maven into {libs} (first run only)"
        log.info(message)
        if progress is not None:
            progress(message)
        shutil.rmtree(libs, ignore_errors=True)  # stale jars of another pom would shadow the new ones
        _run_maven([mvn, "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-Dkafka.version={version}",
                    f"-DoutputDirectory={libs}"], libs, version)
        marker.write_text(digest)
    return libs


def _pom_for(version: str) -> bytes:
    """``infra/kafka/pom.xml`` as Maven resolves it for ``version``: its ``<kafka.version>`` set to it (for the
    pinned version, the pom as it is)."""
    return re.sub(rb"<kafka\.version>[^<]*</kafka\.version>", f"<kafka.version>{version}</kafka.version>".encode(),
                  POM.read_bytes(), count=1)


def _run_maven(cmd: list[str], libs: Path, version: str) -> None:
    """Run ``cmd`` (killed after ``_MVN_TIMEOUT``); BrokerError unless it put a Kafka jar into ``libs``."""
    shown = " ".join(cmd)
    fix = (f"check that Maven Central serves org.apache.kafka:kafka_2.13:{version} and that this host reaches it "
           "(or the mirror in ~/.m2/settings.xml), and retry, or point ROLLSTREAM_BOOTSTRAP_SERVERS at an "
           "existing cluster")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_MVN_TIMEOUT,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        raise BrokerError(f"`{shown}` did not finish within {_MVN_TIMEOUT:.0f} s; {fix}", retriable=True) from exc
    if done.returncode != 0 or not any(libs.glob("kafka_2.13-*.jar")):
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-TAIL_LINES:])
        raise BrokerError(f"Maven could not resolve the Kafka jars (exit {done.returncode}): `{shown}`; "
                          f"its output below says why; {fix}:\n{tail}")


def find_java() -> str:
    """``$JAVA_HOME/bin/java`` if it exists, else ``java`` on PATH.

    Raises:
        BrokerError: neither exists.
    """
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").exists() else shutil.which("java")
    if java is None:
        where = f"at {home}/bin/java (JAVA_HOME) nor on PATH" if home else "on PATH and JAVA_HOME is unset"
        raise BrokerError(f"Java (17 or newer) is not {where}; the local Kafka broker needs it "
                          "(e.g. `apt-get install openjdk-17-jre-headless`, or set JAVA_HOME).")
    return java
