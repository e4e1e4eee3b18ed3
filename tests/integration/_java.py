"""The Java reader of schemas/java, run from tests: its jars resolved by Maven once, the reader itself run by
Java's single-file source launcher (no build, so no compiler plugin to download), and the view of a group
both sides print, so a test compares the Java reader's output with what Python decodes, field for field.

The jars land in ``$ROLLSTREAM_CACHE_DIR`` (or ``~/.cache/rollstream``) ``/java-reader/libs``, marked complete
with the pom's hash, as the Kafka broker's jars are (`rollstream.infra.broker._jars`): an unchanged pom never touches
the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rollstream.infra.broker._files import TAIL_LINES, locked, read_text
from rollstream.infra.broker._jars import find_java
from rollstream.infra.broker._spec import BrokerError
from rollstream.schemas import ScoredGroup
from rollstream.schemas.codec import SCHEMA_DIR

ROOT = Path(__file__).resolve().parents[2]
POM = ROOT / "schemas" / "java" / "pom.xml"
SOURCE = ROOT / "schemas" / "java" / "src" / "main" / "java" / "io" / "rollstream" / "GroupReader.java"
_MVN_TIMEOUT_S = 240.0  # the first resolution downloads Avro and kafka-clients (~15 MB) from Maven Central


def missing_tools() -> str | None:
    """Why the Java reader cannot run here (no Maven, no Java, or a Java without its compiler), or None."""
    if shutil.which("mvn") is None:
        return "Maven (`mvn`) is not on PATH: it resolves the Java reader's jars (e.g. `apt-get install maven`)"
    try:
        java = find_java()
    except BrokerError as exc:
        return str(exc)
    modules = subprocess.run([java, "--list-modules"], capture_output=True, text=True, timeout=30, check=False)
    if "jdk.compiler" not in modules.stdout:
        return (f"{java} has no jdk.compiler module: the single-file source launcher needs a JDK 17+, "
                "not a JRE (e.g. `apt-get install openjdk-17-jdk-headless`)")
    return None


def reader_jars(cache_dir: Path | None = None) -> Path:
    """Resolve the reader's jars (Avro, kafka-clients, slf4j) with Maven once; return their directory.

    Blocks: not at all when cached; else for the Maven run (up to 4 minutes). Process-safe (a file lock).

    Raises:
        RuntimeError: Maven failed (the tail of its output says why).
    """
    pom = POM.read_bytes()
    cache = Path(cache_dir or os.environ.get("ROLLSTREAM_CACHE_DIR") or Path.home() / ".cache" / "rollstream")
    root = cache.expanduser() / "java-reader"
    libs, marker, digest = root / "libs", root / "complete", hashlib.sha256(pom).hexdigest()
    if read_text(marker) == digest:
        return libs
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / ".lock", _MVN_TIMEOUT_S):
        if read_text(marker) == digest:
            return libs
        shutil.rmtree(libs, ignore_errors=True)  # jars of an older pom would shadow the new ones
        cmd = ["mvn", "-B", "-q", "-f", str(POM), "dependency:copy-dependencies", f"-DoutputDirectory={libs}"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_MVN_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, check=False)
        if done.returncode != 0 or not any(libs.glob("avro-*.jar")):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-TAIL_LINES:])
            raise RuntimeError(f"Maven could not resolve the Java reader's jars (exit {done.returncode}): "
                               f"`{' '.join(cmd)}`; check that this host reaches Maven Central:\n{tail}")
        marker.write_text(digest)
    return libs


@dataclass(frozen=True)
class JavaReader:
    """`GroupReader` run by the source launcher with the resolved jars and the package's schemas."""

    libs: Path

    def run(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run the reader with `args` (blocks until it exits; killed after `timeout_s`)."""
        cmd = [find_java(), "-cp", f"{self.libs}/*", str(SOURCE), "--schema-dir", str(SCHEMA_DIR), *args]
        return subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)

    def lines(self, *args: str) -> list[dict[str, Any]]:
        """The JSON lines the reader prints for `args`; AssertionError with its stderr when it fails."""
        done = self.run(*args)
        if done.returncode != 0:
            raise AssertionError(f"GroupReader exited {done.returncode}: {done.stderr[-4000:]}")
        return [json.loads(line) for line in done.stdout.splitlines()]


def python_view(group: ScoredGroup) -> dict[str, Any]:
    """What the Java reader prints for `group` with ``--tokens``, built from Python's decoding of it."""
    samples = group.samples
    return {
        "group_id": group.group_id, "prompt_id": group.prompt_id, "epoch": group.epoch, "status": group.status,
        "error": group.error, "attempt": group.attempt, "max_attempts": group.max_attempts,
        "retriable": group.retriable, "policy_run": group.policy_run, "producer_id": group.producer_id,
        "prompt": group.prompt,
        "metadata": dict(group.metadata), "sampling": None if group.sampling is None else vars(group.sampling),
        "n_prompt_tokens": len(group.prompt_tokens), "prompt_tokens": group.prompt_tokens.tolist(),
        "rewards": [s.reward for s in samples], "token_counts": [len(s.tokens) for s in samples],
        "samples": [{
            "n_tokens": len(s.tokens), "reward": s.reward, "finish_reason": s.finish_reason, "text": s.text,
            "weight_versions": list(s.weight_versions), "has_logprobs": s.logprobs is not None,
            "resume_points": list(s.resume_points), "resumed_from": list(s.resumed_from),
            "tokens": s.tokens.tolist(), "logprobs": None if s.logprobs is None else s.logprobs.tolist(),
            "loss_mask": None if s.loss_mask is None else s.loss_mask.tolist(),
            "version_spans": [[v.version, v.start, v.end] for v in s.version_spans],
        } for s in samples],
    }


def java_view(line: dict[str, Any]) -> dict[str, Any]:
    """A line the Java reader printed, without what Python's group lacks (the Kafka position, key and writer
    schema), its logprobs read back as float32 (Java prints a float's shortest text, Python a double's)."""
    view = {k: v for k, v in line.items() if k not in ("partition", "offset", "key", "schema")}
    view["samples"] = [{**s, "logprobs": None if s["logprobs"] is None
                        else np.asarray(s["logprobs"], dtype=np.float32).tolist()} for s in line["samples"]]
    return view
