"""`rollstream demo`, shortened, end to end through the real CLI against the session broker.

Pinned: it exits 0; it writes a PNG plot, one steps.jsonl line per step (a new policy version each
step) and a summary whose replay check and audit passed, with 0 duplicate groups (producers starting
together move partitions while prompts are in flight: intake drains them, nothing is generated twice);
every producer it started was stopped by it and exited 0, and none is left running; old weight versions
are pruned; it writes report.html (the replayed step in full) and steps.parquet (every taken group).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration._kafka import run_cli

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

STEPS = 12
GROUPS_PER_STEP = 8


def alive(pid: int) -> bool:
    """True while `pid` runs and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
def test_short_demo_trains_replays_audits_and_cleans_up(bootstrap_servers: str, tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    done = run_cli(bootstrap_servers, "demo", "--steps", str(STEPS), "--groups-per-step", str(GROUPS_PER_STEP),
                   "--out", str(out), timeout_s=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mean reward:" in done.stdout and "demo passed" in done.stdout

    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["groups"] == GROUPS_PER_STEP and 0.0 <= r["reward"] <= 1.0 for r in rows)
    assert all(r["staleness_max"] <= 4 for r in rows)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and not summary["problems"]
    assert summary["audit"]["ok"] and "OK: every committed offset" in summary["audit"]["summary"]
    assert summary["audit"]["counts"]["duplicate"] == 0, summary["audit"]  # no rebalance wasted a group
    assert summary["replay"]["ok"] and summary["replay"]["step"] == STEPS // 2
    assert summary["groups"] == STEPS * GROUPS_PER_STEP
    producers = summary["producers"]
    assert len(producers) == 2
    assert all(p["stopped_by_demo"] and p["returncode"] == 0 for p in producers), producers
    assert not [p["pid"] for p in producers if alive(p["pid"])]
    assert all(Path(p["log_path"]).exists() for p in producers)

    # the run written for a person to look at: the report page and every step as Parquet
    assert summary["report"] == str(out / "report.html") and summary["export"] == str(out / "steps.parquet")
    page = (out / "report.html").read_text()
    assert 'id="chart-reward"' in page and f'"{STEPS // 2}":' in page  # the replayed step is shown in full
    pq = pytest.importorskip("pyarrow.parquet")
    table = pq.read_table(out / "steps.parquet", columns=["step", "disposition", "group_id"]).to_pylist()
    taken = {(r["step"], r["group_id"]) for r in table if r["disposition"] == "taken"}
    assert len(taken) == STEPS * GROUPS_PER_STEP and {s for s, _ in taken} == set(range(STEPS))

    kept = sorted(int(p.name[1:]) for p in (out / "weights").iterdir() if p.name[1:].isdigit())
    assert kept == [0, *range(STEPS - 7, STEPS + 1)]  # the base model and the newest 8 versions
    assert not (out / "broker").exists()  # the session broker was used: no local one was started
