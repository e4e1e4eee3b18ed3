"""The report page in a real headless browser (Debian's chromium): it renders, its script runs to the end
without a console message or an error, the token view is filled, and a screenshot shows the plots' lines.

Needs no broker (the page is rendered from records built here). Skipped, saying how to get one, when no
chromium is installed: ``apt-get install -y chromium`` (Debian; ``chromium-browser`` on Ubuntu), or point
``ROLLSTREAM_CHROMIUM`` at a Chrome/Chromium binary. CI (``.ci/run``) installs Debian's chromium and sets
``ROLLSTREAM_REQUIRE_BROWSER=1``: there a missing browser fails the check instead.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from rollstream.consumers.forensics._report_data import ReportData, collect
from rollstream.consumers.forensics._report_page import render

from tests.records import make_resumed_group
from tests.unit.test_export import _step, report_page

REQUIRE_ENV = "ROLLSTREAM_REQUIRE_BROWSER"  # .ci/run sets it: there a missing browser fails the check
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
          "--virtual-time-budget=5000"]
_CONSOLE = re.compile(r":CONSOLE[:(]")  # chromium logs every console message (and uncaught error) so


def _chromium() -> str:
    found = os.environ.get("ROLLSTREAM_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    if not found:
        missing = ("no headless chromium here: apt-get install -y chromium (Debian; chromium-browser on Ubuntu), "
                   "or set ROLLSTREAM_CHROMIUM to a Chrome/Chromium binary")
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 (CI, .ci/run) but {missing}")
        pytest.skip(missing)
    return found


def _run(browser: str, page: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([browser, *_FLAGS, *flags, page.as_uri()], capture_output=True, text=True, timeout=120,
                          cwd=page.parent)


def test_the_console_check_sees_an_error(tmp_path: Path) -> None:
    """The check below is worth something: a page that throws is caught by it."""
    browser = _chromium()
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    assert _CONSOLE.search(_run(browser, bad, "--dump-dom").stderr)


def test_report_renders_without_errors_and_shows_plots(tmp_path: Path) -> None:
    browser = _chromium()
    page = tmp_path / "report.html"
    page.write_text(report_page(token_text=True), encoding="utf-8")
    dom = _run(browser, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not _CONSOLE.search(dom.stderr), [line for line in dom.stderr.splitlines() if _CONSOLE.search(line)]
    assert 'data-ready="1"' in dom.stdout and 'data-errors="0"' in dom.stdout
    tokens = dom.stdout.split('id="tokens"')[1]
    assert tokens.count("<span") == 4 and "t100" in tokens  # the first response's tokens, with their text
    assert dom.stdout.count('<option value="') == 2  # both detail steps can be picked

    shot = tmp_path / "report.png"
    done = _run(browser, page, "--window-size=1300,1400", f"--screenshot={shot}")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    plots = image.crop((0, 100, 1300, 900))  # the plot grid, below the title
    colours = {c for _, c in plots.getcolors(maxcolors=1 << 20)}
    # the reward line (#4e79a7) and the staleness max line (#e15759), anti-aliased: near those colours
    for target in ((0x4E, 0x79, 0xA7), (0xE1, 0x57, 0x59)):
        assert any(sum(abs(a - b) for a, b in zip(c, target, strict=True)) < 30 for c in colours), target


def test_the_token_view_marks_where_a_response_resumed_from_a_checkpoint(tmp_path: Path) -> None:
    browser = _chromium()
    stats, details, zero = collect([_step(0, 0, [make_resumed_group()], ["taken"])], {0})
    page = tmp_path / "report.html"
    page.write_text(render(ReportData("ns", "trainer", tuple(stats), details, zero, 1)), encoding="utf-8")
    dom = _run(browser, page, "--dump-dom")
    assert not _CONSOLE.search(dom.stderr) and 'data-errors="0"' in dom.stdout, dom.stderr[-2000:]
    tokens = dom.stdout.split('id="tokens"')[1].split("</div>")[0]
    assert re.findall(r'class="resume" title="([^"]*)"', tokens) == [
        "resumed here from gpu-a's checkpoint", "resumed here from 节点-🛰's checkpoint"]
    assert tokens.index("resumed here from gpu-a") < tokens.index(">33<") < tokens.index("resumed here from 节点")
    head = dom.stdout.split('id="sample-head"')[1].split("</p>")[0]
    assert "resumed 2×" in head
