"""What the fleet measures inside a process, without changing what it measures.

- `LagReadCounter`: counts the lag gate's broker calls. It wraps `rollstream.infra.LagReader.group_lag` (one *read*;
  and the reads that raised, e.g. timed out) and the three calls a read is made of, looked up by
  `rollstream.infra.lag` at call time: `partitions_of` (a Metadata request), `committed_offsets` (an OffsetFetch to
  the group coordinator) and `watermarks` (per partition; ListOffsets to the partition leader). Counted
  per thread name, so the gate's own thread (``rollstream-lag``) is told apart from the first read
  `LagGate.start` makes through the loop's executor. `requests_per_call` turns the calls into requests
  with the calibration: a read cut short by a timeout then counts only the calls it made (a lower bound:
  librdkafka's own retries of a timed-out request are not seen).
- `ClientStats`: librdkafka statistics (``statistics.interval.ms`` + ``stats_cb``) of chosen consumers:
  cumulative requests per API (``brokers[*].req``), as the client itself counts what it sent. It patches
  the `Consumer` class `rollstream.infra.clients.open_consumer` builds (looked up at call time), adding the two
  properties only to consumers whose group id matches. A stats callback is served only by a consumer that
  polls: right for the control watchers (they poll all the time); the lag reader's consumer never polls,
  so its requests are calibrated once instead (`calibrate_lag_read`, which polls its consumer itself).
- `LoopLagProbe`: a periodic callback on an event loop and how late it ran.

Test tooling only: the patches live for one process (a fleet worker, or the calibration in the driver)
and are undone by `uninstall`/leaving the context.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from rollstream.infra import KafkaConfig, LagReader
from rollstream.infra import clients as infra_clients
from rollstream.infra import lag as infra_lag

CONTROL_WATCH_PREFIX = "rollstream-control-watch-"  # rollstream.infra.control.ControlWatcher's group ids
_CALLS = ("partitions_of", "committed_offsets", "watermarks")


class LagReadCounter:
    """Counts `LagReader.group_lag` calls and the broker calls inside them, by thread name. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: Counter[tuple[str, str]] = Counter()  # (thread kind, "read" | call name) -> calls
        self._undo: list[Callable[[], None]] = []

    def install(self) -> LagReadCounter:
        original_read = LagReader.group_lag

        def counted_read(reader: LagReader, group: str, topic: str, *, timeout: float = 10.0) -> Any:
            self._count("read")
            try:
                return original_read(reader, group, topic, timeout=timeout)
            except Exception:
                self._count("read_failed")
                raise

        LagReader.group_lag = counted_read  # type: ignore[method-assign,assignment]
        self._undo.append(lambda: setattr(LagReader, "group_lag", original_read))
        for name in _CALLS:
            original = getattr(infra_lag, name)
            setattr(infra_lag, name, self._counting(name, original))
            self._undo.append(functools.partial(setattr, infra_lag, name, original))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self._count(name)
            return original(*args, **kwargs)
        return counted

    def _count(self, what: str) -> None:
        thread = threading.current_thread().name
        kind = "gate" if thread.startswith("rollstream-lag") else "other"
        with self._lock:
            self.counts[(kind, what)] += 1

    def snapshot(self) -> dict[str, int]:
        """``{"gate.read": n, "gate.watermarks": n, ..., "other.read": n, ...}``."""
        with self._lock:
            return {f"{kind}.{what}": n for (kind, what), n in sorted(self.counts.items())}


class ClientStats:
    """librdkafka statistics of the consumers whose group id `matches`: cumulative requests per API.

    `install` patches `rollstream.infra.clients.Consumer`; every matching consumer created afterwards emits its
    statistics every `interval_s`, which are folded into `latest` (client name -> {api: requests}) in the
    polling thread (a dict assignment under a lock: the callback never blocks).
    """

    def __init__(self, matches: Callable[[str], bool], *, interval_s: float = 1.0) -> None:
        self._matches = matches
        self._interval_ms = int(interval_s * 1000)
        self._lock = threading.Lock()
        self.latest: dict[str, dict[str, int]] = {}
        self.created: list[Any] = []
        self._original: Any = None

    def install(self) -> ClientStats:
        original = self._original = infra_clients.Consumer

        def factory(conf: dict[str, Any]) -> Any:
            if self._matches(str(conf.get("group.id", ""))):
                conf = {**conf, "statistics.interval.ms": self._interval_ms, "stats_cb": self._on_stats}
                consumer = original(conf)
                self.created.append(consumer)
                return consumer
            return original(conf)

        infra_clients.Consumer = factory  # type: ignore[assignment,misc]
        return self

    def uninstall(self) -> None:
        if self._original is not None:
            infra_clients.Consumer = self._original  # type: ignore[misc]
            self._original = None

    def _on_stats(self, raw: str) -> None:
        try:
            stats = json.loads(raw)
            requests: Counter[str] = Counter()
            for broker in stats.get("brokers", {}).values():
                requests.update({api: int(n) for api, n in broker.get("req", {}).items() if n})
            name = str(stats.get("name", "?"))
        except (ValueError, TypeError, AttributeError):
            return
        with self._lock:
            self.latest[name] = dict(requests)

    def totals(self) -> dict[str, int]:
        """Requests per API summed over every client seen (cumulative, as of each client's last statistics)."""
        with self._lock:
            total: Counter[str] = Counter()
            for requests in self.latest.values():
                total.update(requests)
            return dict(total)

    def clients(self) -> int:
        with self._lock:
            return len(self.latest)


def calibrate_lag_read(config: KafkaConfig, group: str, topic: str, *, reads: int = 5) -> dict[str, float]:
    """Broker requests of one `LagReader.group_lag` on `topic`, per API, from librdkafka's own statistics.

    Blocks a few seconds. One warm-up read first (its ApiVersions, FindCoordinator and connections are a
    one-time cost), then `reads` reads; the difference of the cumulative counters, divided by `reads`.
    """
    stats = ClientStats(lambda g: g == group, interval_s=0.1).install()
    try:
        with LagReader(config) as reader:
            reader.group_lag(group, topic, timeout=30.0)
            before = _settled_totals(stats)
            for _ in range(reads):
                reader.group_lag(group, topic, timeout=30.0)
            after = _settled_totals(stats)
    finally:
        stats.uninstall()
    return {api: (after.get(api, 0) - before.get(api, 0)) / reads for api in sorted(set(after) | set(before))
            if after.get(api, 0) != before.get(api, 0)}


def requests_per_call(calibration: dict[str, float], partitions: int) -> dict[str, dict[str, float]]:
    """Per counted call (`LagReadCounter` names), the requests of each API it costs, from a per-read
    calibration: Metadata per `partitions_of`, OffsetFetch per `committed_offsets`, ListOffsets per
    `watermarks` (a read makes one per partition); anything else (none seen so far) per read."""
    where = {"Metadata": ("partitions_of", 1), "OffsetFetch": ("committed_offsets", 1),
             "ListOffsets": ("watermarks", partitions)}
    out: dict[str, dict[str, float]] = {}
    for api, per_read in calibration.items():
        call, calls_per_read = where.get(api, ("read", 1))
        out.setdefault(call, {})[api] = per_read / calls_per_read
    return out


def _settled_totals(stats: ClientStats) -> dict[str, int]:
    """Serve the statistics of the (never polling) lag-reader consumers until two emissions agree."""
    previous: dict[str, int] | None = None
    for _ in range(50):
        time.sleep(0.25)
        for consumer in stats.created:
            with contextlib.suppress(RuntimeError):
                consumer.poll(0)  # no assignment: returns nothing, serves the queued stats callbacks
        now = stats.totals()
        if now and now == previous:
            return now
        previous = now
    return previous or {}


class LoopLagProbe:
    """Schedules a callback every `interval_s` on the running loop and records how late each one ran (s)."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._samples: list[float] = []
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + self.interval_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self._samples.append(max(0.0, now - self._due))
        self._due = now + self.interval_s
        self._handle = loop.call_at(self._due, self._tick, loop)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()

    def drain(self) -> list[float]:
        """The delays recorded since the last drain (seconds)."""
        samples, self._samples = self._samples, []
        return samples


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    """p50 / p99 / max of `samples` (seconds) in milliseconds; zeros for none."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    data = sorted(samples)

    def at(q: float) -> float:
        return round(data[min(len(data) - 1, int(q * len(data)))] * 1000.0, 2)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(data[-1] * 1000.0, 2), "n": len(data)}


@contextlib.contextmanager
def installed(*probes: LagReadCounter | ClientStats) -> Iterator[None]:
    for probe in probes:
        probe.install()
    try:
        yield
    finally:
        for probe in reversed(probes):
            probe.uninstall()
