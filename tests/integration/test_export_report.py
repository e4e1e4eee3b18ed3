"""`rollstream export` and `rollstream report` against a real broker, through the CLI.

Pinned: an export of steps holds one row per sample of every offset the steps covered (taken, filtered,
undecodable), with the contract's columns; the taken rows are the replayed batch (ids, order, tokens) and
their advantages are its `to_tensors` advantages; pandas, DuckDB and `datasets.load_dataset("parquet")` read
the file as it is (each that is installed); an offset-range export marks records no step covered yet with a
null step; the report is one page holding the plots and the detail step's groups; a step range the group does
not have is an error that names the steps it has.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rollstream.consumers import RolloutConsumer, replay_step
from rollstream.schemas import RollstreamError
from typer.testing import CliRunner

from rollstream.cli import app
from tests.records import make_group, make_multi_turn_group, publish

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

CONTRACT = ("step", "disposition", "reason", "group_id", "prompt_id", "epoch", "attempt", "producer_id",
            "sample_index", "prompt", "text", "reward", "advantage", "finish_reason", "weight_version",
            "trainer_version", "tokens", "logprobs", "loss_mask", "token_versions", "policy_run")


@pytest.fixture
def two_steps(kafka_config, namespace_factory, group_id):
    """Steps 0 (3 groups) and 1 (4 groups) over 2 partitions, with a filtered, a stale and an undecodable
    record among them; then 2 groups no step covered yet."""
    names = namespace_factory(partitions=2)
    publish(kafka_config, names, [make_group("a0", versions=(5,), rewards=(0.0, 1.0, 0.5)),
                                  make_group("eq", rewards=(1.0, 1.0)), make_group("a1", versions=(4,)), b"garbage",
                                  make_group("a2", versions=(5,)), make_multi_turn_group("m")], partition=0)
    publish(kafka_config, names, [make_group("a3", versions=(6,)), make_group("old", versions=(1,)),
                                  make_group("a4", versions=(6,)), make_group("a5", versions=(5,))], partition=1)
    with RolloutConsumer(config=kafka_config, group_id=group_id, namespace=names.namespace, max_staleness=3) as c:
        batches = [c.take(3, timeout=30, policy_version=6), c.take(4, timeout=30, policy_version=6)]
    publish(kafka_config, names, [make_group("later0"), make_group("later1")], partition=0)
    return names, group_id, batches


def _cli(*args: str) -> object:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    return result


def test_export_of_steps_is_every_covered_sample(two_steps, kafka_config, tmp_path: Path) -> None:
    names, group, batches = two_steps
    out = tmp_path / "steps.parquet"
    _cli("export", "--namespace", names.namespace, "--group", group, "--steps", "0:1", "--out", str(out))
    df = pd.read_parquet(out)
    assert set(CONTRACT) <= set(df.columns)
    per_offset = df.drop_duplicates(["partition", "offset"])
    assert sorted(per_offset["disposition"]) == ["filtered", "filtered", "taken", "taken", "taken", "taken", "taken",
                                                "taken", "taken", "undecodable"]
    reasons = dict(zip(per_offset["group_id"].fillna("-"), per_offset["reason"].fillna(""), strict=True))
    assert reasons["eq#0"] == "all_rewards_equal" and reasons["old#0"].startswith("stale")
    for batch in batches:
        replayed = replay_step(kafka_config, names.namespace, group, batch.step)
        taken = df[(df["step"] == batch.step) & (df["disposition"] == "taken")]
        assert list(dict.fromkeys(taken["group_id"])) == batch.group_ids  # the batch, in its order
        expected = replayed.to_batch().to_tensors()
        assert taken["advantage"].tolist() == pytest.approx(expected.advantages.tolist(), abs=1e-6)
        samples = [s for g in batch.groups for s in g.samples]
        assert [list(t) for t in taken["tokens"]] == [s.tokens.tolist() for s in samples]
        assert (taken["trainer_version"] == 6).all()
    multi = df[df["group_id"] == "m#0"].iloc[0]
    assert list(multi["loss_mask"]) == [1, 1, 0, 0, 1] and list(multi["token_versions"]) == [3, 3, 4, 4, 4]
    assert multi["weight_version"] == 3 and multi["staleness"] == 3

    one = tmp_path / "one.parquet"
    _cli("export", "--namespace", names.namespace, "--group", group, "--step", "1", "--out", str(one))
    assert set(pd.read_parquet(one)["step"]) == {1}


def test_export_reads_in_duckdb_and_datasets(two_steps, tmp_path: Path) -> None:
    names, group, _ = two_steps
    out = tmp_path / "steps.parquet"
    _cli("export", "--namespace", names.namespace, "--group", group, "--steps", "0:", "--out", str(out))
    rows = len(pd.read_parquet(out))
    readers = 0
    try:
        import duckdb
    except ImportError:
        pass
    else:
        readers += 1
        mean = duckdb.sql(f"SELECT step, avg(reward) AS r, count(*) AS n FROM '{out}' WHERE disposition = 'taken' "
                          "GROUP BY step ORDER BY step").fetchall()
        assert [s for s, _, _ in mean] == [0, 1] and sum(n for _, _, n in mean) == 15
        assert duckdb.sql(f"SELECT max(len(tokens)) FROM '{out}'").fetchall() == [(6,)]  # a0's third sample
    try:
        import datasets
    except ImportError:
        pass
    else:
        readers += 1
        ds = datasets.load_dataset("parquet", data_files=str(out), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
        assert ds.num_rows == rows and set(CONTRACT) <= set(ds.column_names)
        assert ds.filter(lambda r: r["group_id"] == "m#0")[0]["loss_mask"] == [1, 1, 0, 0, 1]
    if not readers:
        pytest.skip("neither duckdb nor datasets is installed (pip install duckdb datasets)")


def test_export_of_an_offset_range_marks_what_no_step_covered(two_steps, tmp_path: Path) -> None:
    names, group, _ = two_steps
    out = tmp_path / "range.parquet"
    _cli("export", "--namespace", names.namespace, "--group", group, "--from", "0:4", "--out", str(out))
    df = pd.read_parquet(out).drop_duplicates(["partition", "offset"])
    assert df["offset"].tolist() == [4, 5, 6, 7]
    assert df["step"].isna().tolist() == [False, False, True, True]
    assert df["group_id"].tolist() == ["a2#0", "m#0", "later0#0", "later1#0"]


def test_report_is_one_page_with_plots_and_the_detail_step(two_steps, tmp_path: Path) -> None:
    names, group, _ = two_steps
    out = tmp_path / "report.html"
    result = _cli("report", "--namespace", names.namespace, "--group", group, "--detail-step", "1", "--out", str(out))
    assert "2 steps; in full: 1" in result.output  # type: ignore[attr-defined]
    page = out.read_text()
    for chart in ("reward", "staleness", "lag", "skipped", "time", "length"):
        assert f'id="chart-{chart}"' in page
    assert page.count("<circle") > 4 and "use the tool" in page and "a0#0" not in page.split("report-data")[1]


def test_a_step_range_the_group_lacks_names_the_steps_it_has(two_steps, tmp_path: Path) -> None:
    names, group, _ = two_steps
    result = CliRunner().invoke(app, ["export", "--namespace", names.namespace, "--group", group,
                                      "--steps", "5:9", "--out", str(tmp_path / "x.parquet")])
    assert isinstance(result.exception, RollstreamError)
    assert "has no step in 5:9 (steps 0..1)" in str(result.exception)
    both = CliRunner().invoke(app, ["export", "--namespace", names.namespace, "--step", "0", "--steps", "0:1",
                                    "--out", str(tmp_path / "x.parquet")])
    assert both.exit_code == 2 and "give exactly one of" in both.output
    assert not (tmp_path / "x.parquet").exists()


def test_steps_read_back_a_chunk_at_a_time_are_the_same(two_steps, kafka_config, monkeypatch) -> None:
    """`steps_between` keeps where the manifests are, not the manifests: read back (and read from NS.rollouts)
    one step at a time, the steps are the same as read all at once, in order, with every disposition."""
    from rollstream.consumers.forensics import _step_read

    names, group, _ = two_steps
    span = _step_read.steps_between(kafka_config, names.namespace, group, None, None)
    assert span.steps == [0, 1] and all(not m.dispositions for m in span.heads)

    def positions(max_buffered: int = 10_000) -> list[list[tuple[int, int, str]]]:
        return [[(c.record.partition, c.record.offset, c.disposition.kind) for c in step.records]
                for step in _step_read.read_steps(kafka_config, span, max_buffered=max_buffered, timeout=10)]

    whole = positions()
    monkeypatch.setattr(_step_read, "MAX_RUN_OFFSETS", 1)
    assert positions() == positions(max_buffered=1) == whole  # one run per step, paused or not
    assert [len(s) for s in whole] == [len(m.dispositions) for m in span]
    assert [m.step for m in span] == [0, 1] and sum(map(len, whole)) == 10


def test_steps_read_with_partitions_paused_are_the_same(two_steps, kafka_config) -> None:
    """A buffer of one record pauses whichever partition runs ahead of the first unfinished step at every
    turn: the steps come out the same, complete, in order, and the read never stalls."""
    from rollstream.consumers.forensics._step_read import read_steps, steps_between

    names, group, batches = two_steps
    manifests = steps_between(kafka_config, names.namespace, group, None, None)

    def positions(max_buffered: int) -> list[list[tuple[int, int]]]:
        return [[(c.record.partition, c.record.offset) for c in step.records]
                for step in read_steps(kafka_config, manifests, max_buffered=max_buffered, timeout=10)]

    paused = positions(1)
    assert paused == positions(10_000) and [len(s) for s in paused] == [len(m.dispositions) for m in manifests]
    assert [p for s in paused for p in s if p in {pos for b in batches for pos in b.positions}] == [
        pos for b in batches for pos in b.positions]
