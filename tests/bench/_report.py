"""The bench report: what machine it ran on, and per part what was compared, how, and the figures."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import confluent_kafka
import fastavro
import numpy as np


@dataclass(frozen=True)
class Part:
    """One section of the report."""

    title: str
    how: str
    rows: list[tuple[str, str]]
    seconds: float


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    return "unknown"


def _commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}{' + uncommitted changes' if dirty else ''}"


def machine_facts(kafka_version: str, load_before: tuple[float, ...],
                  load_after: tuple[float, ...]) -> list[tuple[str, str]]:
    """(fact, value) rows describing the machine and the software the figures were measured with."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        ("date (UTC)", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")),
        ("CPU", _cpu_model()),
        ("cores", f"{os.cpu_count()} ({usable} usable by this process), shared with the broker"),
        ("memory", _memory()),
        ("OS", platform.platform()),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("confluent-kafka / librdkafka", f"{confluent_kafka.__version__} / {confluent_kafka.libversion()[0]}"),
        ("fastavro / numpy", f"{fastavro.__version__} / {np.__version__}"),
        ("Kafka", kafka_version),
        ("rollstream commit", _commit()),
        ("load average (1 min) before / after", f"{load_before[0]:.2f} / {load_after[0]:.2f}"),
    ]


def _table(rows: list[tuple[str, str]], header: tuple[str, str]) -> list[str]:
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {name} | {value.replace('|', '/')} |" for name, value in rows]
    return lines


def render(facts: list[tuple[str, str]], parts: list[Part], seconds: float) -> str:
    """The whole report as markdown."""
    lines = [
        "# rollstream benchmark report", "",
        "Every figure is a side-by-side comparison measured in this one run, on this machine; ratios are "
        "rollstream / the alternative (higher is better for rollstream). The machine is small and shared, so "
        "absolute numbers are noisy: read the ratios. `python -m tests.bench` regenerates this file.", "",
        "## Machine", "", *_table(facts, ("", "")), "",
    ]
    for part in parts:
        lines += [f"## {part.title}", "", f"How: {part.how}", "", *_table(part.rows, ("figure", "value")), "",
                  f"_{part.seconds:.0f} s_", ""]
    lines.append(f"Total bench time: {seconds / 60:.1f} min.")
    return "\n".join(lines) + "\n"
