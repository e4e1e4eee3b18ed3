"""Resident memory over time of the supervised processes (``VmRSS`` in ``/proc/<pid>/status``; Linux only).

A named thread samples every role's live process every few seconds. Each run of a role (a restart is a new
pid) is a series of its own, so a report shows growth within one process life, never across a restart.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos._procs import Role


def rss_kib(pid: int) -> int | None:
    """The process's resident set size in KiB, or None when it is gone (or this is not Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Series:
    """One process life of a role: (seconds since sampling began, RSS KiB) samples."""

    role: str
    pid: int
    points: list[tuple[float, int]] = field(default_factory=list)

    def growth_mib_per_min(self, skip_s: float = 30.0) -> float | None:
        """Least-squares slope after the first `skip_s` (start-up and first fetches), MiB per minute."""
        pts = [(t, kib) for t, kib in self.points if t - self.points[0][0] >= skip_s]
        if len(pts) < 3:
            return None
        n = len(pts)
        mt, mk = sum(t for t, _ in pts) / n, sum(k for _, k in pts) / n
        var = sum((t - mt) ** 2 for t, _ in pts)
        return None if var == 0 else sum((t - mt) * (k - mk) for t, k in pts) / var * 60 / 1024


class RssSampler:
    """Samples `roles` every `every_s` on a daemon thread named ``chaos-rss`` until `stop`."""

    def __init__(self, roles: list[Role], every_s: float = 5.0) -> None:
        self.roles, self.every_s = roles, every_s
        self.series: list[Series] = []
        self._current: dict[str, Series] = {}
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-rss", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def sample(self) -> None:
        now = time.monotonic() - self._started
        for role in self.roles:
            proc = role.proc
            if proc is None or role.stopped:
                continue
            kib = rss_kib(proc.pid)
            if kib is None:
                continue
            series = self._current.get(role.name)
            if series is None or series.pid != proc.pid:
                series = self._current[role.name] = Series(role.name, proc.pid)
                self.series.append(series)
            series.points.append((now, kib))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()


def render_rss(series: list[Series], columns: int = 8) -> list[str]:
    """The report's "Memory" section: per process life, RSS at evenly spaced times and the growth rate."""
    if not series:
        return []
    lines = ["## Memory (RSS over time, MiB; one row per process life)", "",
             "| process | pid | samples | RSS at evenly spaced times (s: MiB) | min | max | growth after 30 s |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for s in series:
        if not s.points:
            continue
        step = max(1, len(s.points) // columns)
        picks = s.points[::step] + ([s.points[-1]] if (len(s.points) - 1) % step else [])
        shown = ", ".join(f"{t:.0f}: {kib / 1024:.1f}" for t, kib in picks)
        sizes = [kib for _, kib in s.points]
        slope = s.growth_mib_per_min()
        rate = "-" if slope is None else f"{slope:+.2f} MiB/min"
        lines.append(f"| {s.role} | {s.pid} | {len(s.points)} | {shown} | {min(sizes) / 1024:.1f} | "
                     f"{max(sizes) / 1024:.1f} | {rate} |")
    return [*lines, ""]
