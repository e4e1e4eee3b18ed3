"""Rollstream's records are readable from Java: the reader in schemas/java (Apache Avro, the package's own
.avsc files) prints, for groups Python published on a real broker, exactly what Python decodes.

Three behaviours are pinned here:
1. Field for field, the Java reader's view of every group on NS.rollouts equals Python's (multi-sample groups of
   different lengths, a failed group, rewards that are None, non-ASCII text beyond the BMP, attempts, loss masks
   and version spans, trainer runs, resume points), including records of the previous schemas (v4, v5, v6), which
   Avro resolution brings to v7 with the values Python's upgraders give.
2. Avro Java's fingerprints (`SchemaNormalization.parsingFingerprint64`) are Python's, for every schema file.
3. An unknown fingerprint, and a version Avro resolution cannot bring to the current schema (v3), are refused
   with a non-zero exit and a message naming them.
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import fastavro
import pytest
from rollstream.infra import KafkaConfig
from rollstream.schemas import (
    Sample,
    Samples,
    ScoredGroup,
    default_codec,
    encode,
    fingerprint,
    float32_array,
    int32_array,
    make_group_id,
)
from rollstream.schemas.codec import MAGIC, SCHEMA_DIR

from tests.conftest import NamespaceFactory
from tests.integration._java import JavaReader, java_view, missing_tools, python_view, reader_jars
from tests.integration._kafka import read_records
from tests.records import make_group, make_multi_turn_group, make_resumed_group, publish

_MISSING = missing_tools()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"the Java reader cannot run here: {_MISSING}")


@pytest.fixture(scope="module")
def java_reader() -> JavaReader:
    """The reader with its jars (resolved by Maven on the first run only; a minute or so then)."""
    return JavaReader(reader_jars())


def _old_record(history_file: str, group: ScoredGroup, dropped: tuple[str, ...]) -> bytes:
    """`group` as a producer of an older schema wrote it: its current datum less `dropped`, written by fastavro."""
    datum = fastavro.schemaless_reader(io.BytesIO(encode(group)[len(MAGIC) + 8:]), default_codec().schema(ScoredGroup),
                                       None)
    if not isinstance(datum, dict):
        raise TypeError(f"a ScoredGroup body read as {type(datum).__name__}")
    schema: dict[str, Any] = json.loads((SCHEMA_DIR / "history" / history_file).read_text())
    body = io.BytesIO()
    old = {k: v for k, v in datum.items() if k not in dropped}
    fastavro.schemaless_writer(body, fastavro.parse_schema(schema), old)
    return MAGIC + fingerprint(schema) + body.getvalue()


_V7_FIELDS = ("resume_point_counts", "resume_points", "resumed_from_lengths", "resumed_from")
_V6_FIELDS = ("policy_run", *_V7_FIELDS)
_V5_FIELDS = ("attempt", "max_attempts", "retriable", "source_prompt", *_V6_FIELDS)


def _groups() -> list[ScoredGroup]:
    unicode_id = "naïve-📐"
    unicode = ScoredGroup(
        group_id=make_group_id(unicode_id, 0), prompt_id=unicode_id, epoch=0, prompt_tokens=int32_array([7], "p"),
        started_at_ms=1, finished_at_ms=2, prompt="Größe? 大小?", metadata={"lang": "de/zh", "ключ": "значение"},
        samples=Samples.of([
            Sample(tokens=int32_array([1, 2, 3], "t"), text="𝔾röße 🙂 大", reward=0.25,
                   logprobs=float32_array([-0.1, -0.2, -0.3], "l")),
            Sample(tokens=int32_array([4], "t"), text="", reward=-1.0, finish_reason="abort"),
            Sample(tokens=int32_array([5, 6], "t"), text="é\n\"q\"\t\\", reward=None)]))
    return [
        replace(make_group("multi", 1, rewards=(0.5, None, -1.25, 1e-7), versions=(3,)), attempt=2, max_attempts=4),
        make_group("failed", status="failed", rewards=(None, None), logprobs=False),
        unicode,
        make_multi_turn_group(),
        replace(make_group("retry", 2, rewards=(1.0,)), attempt=1, max_attempts=3, retriable=True, policy_run=3),
        make_resumed_group(),
    ]


def test_java_reader_prints_what_python_decodes(kafka_config: KafkaConfig, namespace_factory: NamespaceFactory,
                                                java_reader: JavaReader) -> None:
    names = namespace_factory(partitions=2)
    groups = _groups()
    v4_group, v5_group = make_multi_turn_group("old"), replace(make_group("v5", rewards=(1.0,)), attempt=1)
    v6_group = replace(make_group("v6", rewards=(1.0,)), policy_run=2)
    publish(kafka_config, names, [*groups, _old_record("scored_group.v4.avsc", v4_group, _V5_FIELDS),
                                  _old_record("scored_group.v5.avsc", v5_group, _V6_FIELDS),
                                  _old_record("scored_group.v6.avsc", v6_group, _V7_FIELDS)])
    lines = java_reader.lines("--bootstrap-servers", kafka_config.bootstrap_servers, "--topic", names.rollouts,
                              "--tokens", "--timeout-s", "30")
    python = {(p, o): python_view(g) for p, o, g in read_records(kafka_config, names.rollouts, ScoredGroup)}
    java = {(line["partition"], line["offset"]): java_view(line) for line in lines}
    assert len(lines) == len(groups) + 3
    assert java == python
    by_id = {line["group_id"]: line for line in lines}
    assert {g.group_id: by_id[g.group_id]["key"] for g in groups} == {g.group_id: g.group_id for g in groups}
    old = by_id[v4_group.group_id]
    assert old["schema"] == "history/scored_group.v4.avsc"  # resolved by Avro, not re-encoded
    assert (old["attempt"], old["max_attempts"], old["retriable"], old["policy_run"]) == (0, 1, False, 0)
    v5 = by_id[v5_group.group_id]
    assert (v5["schema"], v5["attempt"], v5["policy_run"]) == ("history/scored_group.v5.avsc", 1, 0)
    v6 = by_id[v6_group.group_id]
    assert (v6["schema"], v6["policy_run"]) == ("history/scored_group.v6.avsc", 2)
    assert v6["samples"][0]["resume_points"] == v6["samples"][0]["resumed_from"] == []
    assert by_id["retry#2"]["policy_run"] == 3
    resumed = by_id["r#0"]["samples"]
    assert [(s["resume_points"], s["resumed_from"]) for s in resumed] == [([2, 4], ["gpu-a", "节点-🛰"]), ([], []),
                                                                         ([0], ["gpu-b"])]
    assert by_id["multi#1"]["rewards"] == [0.5, None, -1.25, 1e-7]
    assert by_id["multi#1"]["token_counts"] == [4, 5, 6, 7]


def test_java_fingerprints_are_pythons(java_reader: JavaReader) -> None:
    done = java_reader.run("--fingerprints")
    assert done.returncode == 0, done.stderr
    java = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert java == default_codec().fingerprints()
    assert len(java) == len(list(SCHEMA_DIR.glob("*.avsc"))) + len(list(SCHEMA_DIR.glob("history/*.avsc")))


def test_java_reader_refuses_unknown_and_unresolvable_records(tmp_path: Path, java_reader: JavaReader) -> None:
    unknown = tmp_path / "unknown.bin"
    unknown.write_bytes(MAGIC + bytes.fromhex("0123456789abcdef") + encode(make_group("u"))[len(MAGIC) + 8:])
    done = java_reader.run("--file", str(unknown))
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown schema fingerprint 0123456789abcdef" in done.stderr and str(unknown) in done.stderr

    v3 = tmp_path / "v3.bin"
    v4_only = ("sampling", "has_loss_mask", "version_span_counts", "version_spans", "loss_masks")
    v3.write_bytes(_old_record("scored_group.v3.avsc", make_group("x"), _V5_FIELDS + v4_only))
    done = java_reader.run("--file", str(v3))
    assert done.returncode == 2, done.stdout
    assert "history/scored_group.v3.avsc" in done.stderr and "has_loss_mask" in done.stderr
