"""The chaos run's memory section (`tests.chaos._rss`): VmRSS read from /proc, growth as a least-squares slope."""

from __future__ import annotations

import os
import sys

import pytest

from tests.chaos._rss import Series, render_rss, rss_kib


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmRSS is read from /proc")
def test_rss_of_this_process_and_of_none() -> None:
    assert (rss_kib(os.getpid()) or 0) > 1024
    assert rss_kib(2**22 + 12345) is None  # beyond pid_max: no such process


def test_growth_skips_the_start_and_renders_one_row_per_process_life() -> None:
    flat = Series("trainer", 1, [(0.0, 50_000), *((float(t), 80_000) for t in range(30, 200, 5))])
    growing = Series("trainer", 2, [(float(t), 80_000 + 10 * t) for t in range(0, 200, 5)])
    assert flat.growth_mib_per_min() == pytest.approx(0.0)
    assert growing.growth_mib_per_min() == pytest.approx(600 / 1024)
    assert Series("producer-1", 3, [(0.0, 1), (40.0, 2)]).growth_mib_per_min() is None  # too few samples
    lines = render_rss([flat, growing])
    assert lines[0].startswith("## Memory") and len([line for line in lines if line.startswith("| trainer")]) == 2
    assert "+0.59 MiB/min" in lines[-2] and render_rss([]) == []
