"""The brokers' own request counts by API (JMX ``RequestMetrics``), read by `BrokerRequests.java`.

One helper JVM for the whole run (the JDK's single-file launcher compiles it in memory, ~1 s): it attaches
to the three broker JVMs once and answers each `snapshot` with their cumulative counts. This is the
broker-side view of a phase, every client included (the producers' intake, publisher and control
watcher, the trainer, the driver's lag sampler); the client-side counters (`tests.fleet._probes`) say
which of those requests the lag gates made. Without a JDK (``java`` missing, no jdk.attach) the run goes
on without it and says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

_SOURCE = Path(__file__).with_name("BrokerRequests.java")
# Per-type breakdowns of Fetch that Kafka counts again under their own name; left out of totals.
BREAKDOWNS = frozenset({"FetchConsumer", "FetchFollower"})
LAG_READ_APIS = ("ListOffsets", "OffsetFetch", "Metadata")  # what one LagReader.group_lag sends


class BrokerRequests:
    """`snapshot()` -> {api: requests so far, summed over the brokers}. `close()` is idempotent."""

    def __init__(self, pids: list[int], timeout_s: float = 60.0) -> None:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("no `java` on PATH")
        self._proc = subprocess.Popen([java, "-Xmx64m", "-XX:TieredStopAtLevel=1", str(_SOURCE), *map(str, pids)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        self._lock = threading.Lock()
        first = self._line(timeout_s)
        if not first.get("ready"):
            raise RuntimeError(f"BrokerRequests.java did not start: {self._stderr()}")

    def _line(self, timeout_s: float) -> dict[str, Any]:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self._proc.stdout.readline()  # type: ignore[union-attr]
                                                               ), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            raise RuntimeError(f"BrokerRequests.java gave no answer within {timeout_s:g} s: {self._stderr()}")
        return dict(json.loads(result[0]))

    def _stderr(self) -> str:
        if self._proc.poll() is None:
            return "(still running)"
        return (self._proc.stderr.read() if self._proc.stderr else "")[-500:]

    def snapshot(self, timeout_s: float = 30.0) -> tuple[float, dict[str, int]]:
        """(time, cumulative requests per API over every broker). Blocks up to `timeout_s`."""
        with self._lock:
            assert self._proc.stdin is not None  # noqa: S101 - Popen(stdin=PIPE)
            self._proc.stdin.write("\n")
            self._proc.stdin.flush()
            per_broker = self._line(timeout_s)
        total: dict[str, int] = {}
        for counts in per_broker.values():
            for api, n in counts.items():
                total[api] = total.get(api, 0) + int(n)
        return time.time(), total

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                if self._proc.stdin is not None:
                    self._proc.stdin.close()
                self._proc.wait(10.0)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()


def rates(before: tuple[float, dict[str, int]], after: tuple[float, dict[str, int]]) -> dict[str, float]:
    """Requests per second per API between two snapshots, the busiest first (zero rates left out)."""
    seconds = max(1e-9, after[0] - before[0])
    out = {api: (n - before[1].get(api, 0)) / seconds for api, n in after[1].items()}
    return {api: round(r, 1) for api, r in sorted(out.items(), key=lambda kv: -kv[1]) if r > 0}


def window_figures(before: tuple[float, dict[str, int]] | None,
                   after: tuple[float, dict[str, int]] | None) -> dict[str, Any] | None:
    """The brokers' request rates in the window: by API, in all, and those a lag read is made of."""
    if before is None or after is None:
        return None
    by_api = rates(before, after)
    return {"requests_per_s": by_api,
            "total_requests_per_s": round(sum(r for api, r in by_api.items() if api not in BREAKDOWNS), 1),
            "lag_read_apis_per_s": round(sum(by_api.get(api, 0.0) for api in LAG_READ_APIS), 1)}
