"""Export and report without a broker: the Parquet columns (the contract's names and types), one row per sample
and one per record without samples, advantages exactly as `to_tensors`, row groups bounded, the step chunks
bounded, and a report page that fetches nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from rollstream.consumers.forensics import _export
from rollstream.consumers.forensics._replay import ReplayedRecord
from rollstream.consumers.forensics._report_data import ReportData, collect
from rollstream.consumers.forensics._report_page import render
from rollstream.consumers.forensics._step_read import Covered, CoveredStep, _runs
from rollstream.schemas import OffsetDisposition, PartitionRange, ScoredGroup, StepManifest, encode

from rollstream.cli._inspect import parse_steps
from tests.records import make_group, make_multi_turn_group, make_resumed_group

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CONTRACT = ("step", "disposition", "reason", "group_id", "prompt_id", "epoch", "attempt", "producer_id",
            "sample_index", "prompt", "text", "reward", "advantage", "finish_reason", "weight_version",
            "trainer_version", "tokens", "logprobs", "loss_mask", "token_versions", "policy_run", "resumed",
            "resume_points", "resumed_from")


def _step(step: int, start: int, groups: list[ScoredGroup | None], kinds: list[str], *, version: int = 6
          ) -> CoveredStep:
    dispositions = tuple(OffsetDisposition(0, start + i, kind, None if g is None else g.group_id,
                                           None if kind == "taken" else f"{kind} because")
                         for i, (g, kind) in enumerate(zip(groups, kinds, strict=True)))
    manifest = StepManifest(step, "trainer", "ns.rollouts", (PartitionRange(0, start, start + len(groups)),),
                            dispositions, created_at_ms=10_000 + step, policy_version=version)
    records = [ReplayedRecord(0, start + i, 9_000 + i, None if g is None else g.group_id,
                              b"junk" if g is None else encode(g), g, "not a record" if g is None else None)
               for i, g in enumerate(groups)]
    return CoveredStep(manifest, tuple(Covered(r, d, manifest) for r, d in zip(records, dispositions, strict=True)))


def _steps() -> list[CoveredStep]:
    return [
        _step(0, 0, [make_group("a", versions=(3,), rewards=(0.0, 1.0, 0.5)), make_multi_turn_group(), None],
              ["taken", "taken", "undecodable"]),
        _step(1, 3, [make_group("f", status="failed", rewards=()), make_group("e", rewards=(1.0, 1.0)),
                     make_group("b", versions=(5,), rewards=(0.0, 0.0))], ["filtered", "filtered", "taken"]),
    ]


def test_export_has_the_contract_columns_and_a_row_per_sample(tmp_path: Path) -> None:
    summary = _export.write_steps(_steps(), tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet")
    assert set(CONTRACT) <= set(table.column_names) and tuple(table.column_names) == _export.COLUMNS
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())
    rows = table.to_pylist()
    # 3 + 2 samples, the undecodable record, the failed group without samples, 2 + 2 samples
    assert summary.rows == len(rows) == 11 and summary.records == 6 and summary.steps == 2
    assert [(r["step"], r["disposition"], r["group_id"], r["sample_index"]) for r in rows[5:7]] == [
        (0, "undecodable", None, None), (1, "filtered", "f#0", None)]
    assert rows[5]["reason"] == "undecodable because" and rows[6]["error"] == "engine exploded"
    multi = [r for r in rows if r["group_id"] == "m#0"]
    assert multi[0]["loss_mask"] == [1, 1, 0, 0, 1] and multi[0]["token_versions"] == [3, 3, 4, 4, 4]
    assert multi[0]["weight_version"] == 3 and multi[0]["staleness"] == 3 and multi[0]["trainer_version"] == 6
    assert multi[1]["loss_mask"] == [1, 1] and multi[1]["finish_reason"] == "length"
    first = rows[0]
    assert first["tokens"] == [100, 101, 102, 103] and first["prompt"] == "prompt a" and first["text"] == "answer 0"
    assert first["logprobs"] == pytest.approx([-0.5, -1.5, -2.5, -3.5]) and first["timestamp_ms"] == 9_000


def test_export_says_where_samples_resumed_from_a_checkpoint(tmp_path: Path) -> None:
    _export.write_steps([*_steps(), _step(2, 6, [make_resumed_group()], ["taken"])], tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet")
    assert table.schema.field("resumed").type == pa.bool_()
    assert table.schema.field("resume_points").type == pa.list_(pa.int32())
    assert table.schema.field("resumed_from").type == pa.list_(pa.string())
    rows = table.to_pylist()
    assert [(r["resumed"], r["resume_points"], r["resumed_from"]) for r in rows if r["group_id"] == "r#0"] == [
        (True, [2, 4], ["gpu-a", "节点-🛰"]), (False, [], []), (True, [0], ["gpu-b"])]
    assert rows[0]["resumed"] is False and rows[0]["resume_points"] == [] and rows[0]["resumed_from"] == []
    assert rows[5]["resumed"] is None and rows[5]["resume_points"] is None and rows[5]["resumed_from"] is None


def test_export_advantages_are_what_to_tensors_trains_on(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from rollstream.consumers._batch import tensors_of

    steps = _steps()
    _export.write_steps(steps, tmp_path / "x.parquet")
    rows = pq.read_table(tmp_path / "x.parquet").to_pylist()
    for step in steps:
        taken = [c.record.group for c in step.records if c.disposition.kind == "taken"]
        expected = tensors_of(taken).advantages.tolist()
        got = [r["advantage"] for r in rows if r["step"] == step.manifest.step and r["disposition"] == "taken"]
        assert got == pytest.approx(expected, abs=1e-6)
    equal = [r["advantage"] for r in rows if r["group_id"] == "e#0"]
    assert equal == [0.0, 0.0]  # a filtered group: what it would have been


def test_export_writes_bounded_row_groups_and_no_partial_file(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_export, "ROW_GROUP_ROWS", 3)
    summary = _export.write_steps(_steps(), tmp_path / "x.parquet")
    meta = pq.ParquetFile(tmp_path / "x.parquet").metadata
    assert summary.row_groups == meta.num_row_groups >= 3
    assert all(meta.row_group(i).num_rows <= 3 for i in range(meta.num_row_groups))
    assert [p.name for p in tmp_path.iterdir()] == ["x.parquet"]
    empty = _export.write_steps([], tmp_path / "empty.parquet")
    assert empty.rows == 0 and pq.read_table(tmp_path / "empty.parquet").column_names == list(_export.COLUMNS)


def test_adjacent_steps_are_read_in_one_go_and_far_ones_apart() -> None:
    def manifest(step: int, *ranges: tuple[int, int, int]) -> StepManifest:
        return StepManifest(step, "g", "t", tuple(PartitionRange(*r) for r in ranges), ())

    steps = [manifest(k, (0, 10 * k, 10 * k + 10), (1, 5 * k, 5 * k + 5)) for k in range(10)]
    far = manifest(10, (0, 10_000, 10_010))  # a seek: not read across the gap
    back = manifest(11, (0, 0, 10))  # a seek back: a read of its own
    near = manifest(12, (0, 30, 40))  # within the gap allowed of the one before
    assert [[m.step for m in run] for run in _runs([*steps, far, back, near], 35, 10_000)] == [
        list(range(10)), [10], [11, 12]]
    # A run covers at most `most` offsets (its manifests are held until its last step is out), at least one step.
    assert [[m.step for m in run] for run in _runs(iter(steps[:5]), 35, 30)] == [[0, 1], [2, 3], [4]]
    assert [[m.step for m in run] for run in _runs(steps[:2], 35, 1)] == [[0], [1]]


def test_parse_steps() -> None:
    import typer

    assert parse_steps("3:7") == (3, 7) and parse_steps("3:") == (3, None) and parse_steps(":7") == (None, 7)
    for bad in ("7:3", "3", "a:b"):
        with pytest.raises(typer.BadParameter, match="--steps takes A:B"):
            parse_steps(bad)


def report_page(token_text: bool = False) -> str:
    """A report page of `_steps()` (both in full), as `write_report` renders it."""
    stats, details, zero = collect(_steps(), {0, 1},
                                   token_text=(lambda ids: [f"t{i}" for i in ids]) if token_text else None)
    return render(ReportData("ns", "trainer", tuple(stats), details, zero, 1_700_000_000_000))


def test_report_page_is_self_contained() -> None:
    page = report_page()
    assert 'id="chart-reward"' in page and 'id="chart-lag"' in page and 'id="report-data"' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched at view time
    assert "@import" not in page and "fetch(" not in page
    assert "</script>" not in page.split('id="report-data">')[1].split("</script>")[0]
    assert "prompt b" in page  # the all-zero prompt is listed


def test_report_detail_shows_tokens_within_the_step_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollstream.consumers.forensics import _report_data

    monkeypatch.setattr(_report_data, "MAX_STEP_TOKENS", 6)
    _, details, _ = collect(_steps(), {0})
    samples = [s for g in details[0] if "samples" in g for s in g["samples"]]
    assert [(len(s["tokens"]), s["length"], s["cut"]) for s in samples] == [
        (4, 4, False), (2, 5, True), (0, 6, True), (0, 5, True), (0, 2, True)]
    assert all(len(s["logprobs"]) == len(s["versions"]) == len(s["tokens"]) for s in samples)
    assert [g["disposition"] for g in details[0]] == ["taken", "taken", "undecodable"]


def test_report_marks_where_a_sample_resumed_from_a_checkpoint() -> None:
    steps = [_step(0, 0, [make_resumed_group(), make_group("a")], ["taken", "taken"])]
    stats, details, zero = collect(steps, {0})
    assert [s["resumes"] for s in details[0][0]["samples"]] == [[[2, "gpu-a"], [4, "节点-🛰"]], [], [[0, "gpu-b"]]]
    assert all(s["resumes"] == [] for s in details[0][1]["samples"])
    page = render(ReportData("ns", "trainer", tuple(stats), details, zero, 1_700_000_000_000))
    data = json.loads(page.split('id="report-data">')[1].split("</script>")[0])
    assert data["details"]["0"][0]["samples"][0]["resumes"] == [[2, "gpu-a"], [4, "节点-🛰"]]
    assert "resumed here from " in page  # the marker's title (tests/integration/test_report_browser.py shows it)


def test_export_without_pyarrow_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rollstream.schemas import RollstreamError

    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)  # as if not installed
    with pytest.raises(RollstreamError, match=r"pip install 'rollstream\[export\]'"):
        _export.write_steps(_steps(), tmp_path / "x.parquet")
