"""``--churn``: a fleet phase that changes while the trainer takes (`tests.fleet._phase.Phase` runs it).

The measured window is cut into five segments of ``--seconds`` each, one event at the start of each but the
first (the baseline):

1. ``worker-killed``: one producer process (``--per-process`` producers, a quarter of 128 at 32 each) is
   SIGKILLed and a new process with as many new producers (new ids) is started;
2. ``worker-drained``: another producer process gets SIGTERM (it finishes its in-flight groups, commits, stops);
3. ``node-killed``: one broker node (``--churn-node``) is SIGKILLed;
4. ``node-restarted``: that node is started again on its own data (`tests.chaos._cluster.Cluster.restart_node`;
   the segment before runs on until it serves, this one starts then).

Figures (`figures`), from the trainer's steps and the lag sampled every 0.1 s:

- the bound at each moment (docs/operations.md, "When producers come and go"): max_lag + concurrency x the
  producers of the processes alive + for each producer that left, share + 1 + concurrency, its share being
  max_lag x the partitions it can have owned / all partitions; a producer owns at most ceil(partitions / the
  producers alive after the event) partitions with the balanced assignors, so that is taken. A node kill
  changes no term (the producers alive and their shares stay), so the bound after it is the one before;
- per segment: the lag's max, the share of samples over max_lag and over max_lag + in flight (the bound of a
  fleet that does not change), the longest stretch over each, and the seconds from the event until the lag was
  back within max_lag + in flight for good;
- throughput recovery per event: the trainer's steps/s in a sliding ``RATE_WINDOW_S`` window; recovered at the
  first moment from which the next window's steps/s is at least ``RECOVERED`` x the baseline segment's
  (0 s: it never fell below that), and the lowest window rate seen in the segment.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollstream.infra.broker import BrokerError

from tests.chaos._cluster import Cluster

if TYPE_CHECKING:
    from tests.fleet._phase import Phase


class FleetError(RuntimeError):
    """A phase could not run (a producer process died, the fleet did not start, the drain stuck)."""

EVENTS = ("worker-killed", "worker-drained", "node-killed", "node-restarted")
RATE_WINDOW_S = 5.0
RECOVERED = 0.8
MIN_PROCESSES = 3  # one killed, one drained, one that stays throughout


@dataclass
class Event:
    name: str
    t: float  # wall clock when it was done
    live: int  # producers of the processes alive after it (starting ones included)
    leavers: int  # producers that left so far
    bound: int  # the bound from this moment on
    detail: str = ""


def leaver_term(max_lag: int, partitions: int, live_after: int, concurrency: int) -> int:
    """What one producer that left can leave outstanding: floor(its share) + 1 + its concurrency."""
    owned = math.ceil(partitions / max(1, live_after))
    return math.floor(max_lag * owned / partitions) + 1 + concurrency


class Churn:
    """The events of one churn phase, in order, each followed by a segment of `segment_s` of watching."""

    def __init__(self, phase: Phase, cluster: Cluster, node: int) -> None:
        self.phase, self.cluster, self.node = phase, cluster, node
        self.events: list[Event] = []
        self._leaver_terms = 0
        self._leavers = 0

    def _bound(self, live: int) -> int:
        s = self.phase.spec
        return s.max_lag + s.concurrency * live + self._leaver_terms

    def _live(self) -> int:
        return sum(int(w.spec["count"]) for w in self.phase.active)

    def _leave(self, count: int, live_after: int) -> None:
        s = self.phase.spec
        self._leaver_terms += count * leaver_term(s.max_lag, s.partitions, live_after, s.concurrency)
        self._leavers += count

    def _mark(self, name: str, detail: str = "") -> None:
        live = self._live()
        event = Event(name, time.time(), live, self._leavers, self._bound(live), detail)
        self.events.append(event)
        self.phase.say(f"{self.phase.spec.label}: churn: {name}{' (' + detail + ')' if detail else ''}; "
                       f"{live} producers alive, {self._leavers} left; lag bound now {event.bound}")

    def run(self, t0: float, watch: Callable[[float], None]) -> float:
        """The five segments from `t0`; returns the window's end."""
        seg = self.phase.spec.seconds
        self._mark("baseline")
        watch(t0 + seg)
        self.kill_worker()
        watch(self.events[-1].t + seg)
        self.drain_worker()
        watch(self.events[-1].t + seg)
        self._mark("node-killed", f"node {self.node} SIGKILLed")
        self.cluster.kill(self.node)
        watch(self.events[-1].t + seg)
        took = self.restart_node()
        self._mark("node-restarted", f"node {self.node} started again, serving {took:.1f} s after the start")
        watch(self.events[-1].t + seg)
        return time.time()

    def restart_node(self) -> float:
        """`Cluster.restart_node`, once more if the first start fails; FleetError if that fails too."""
        try:
            return self.cluster.restart_node(self.node, timeout_s=120.0)
        except BrokerError as exc:
            self.phase.say(f"{self.phase.spec.label}: churn: node {self.node} did not restart ({str(exc)[:200]}); "
                           "once more")
        try:
            return self.cluster.restart_node(self.node, timeout_s=120.0)
        except BrokerError as exc:
            raise FleetError(f"--churn: node {self.node} did not restart: {exc}") from exc

    def kill_worker(self) -> None:
        p = self.phase
        victim = p.active[0]
        p.active.remove(victim)
        victim.proc.send_signal(signal.SIGKILL)
        victim.wait(10.0)
        p.killed.append(victim)
        count = int(victim.spec["count"])
        self._leave(count, self._live())
        replacement = p._worker(p.config.bootstrap_servers, f"new{victim.spec['proc']}", p.spec.mode,  # noqa: SLF001
                                p.spec.producers + int(victim.spec["first_index"]), count)
        p.workers.append(replacement)
        p.active.append(replacement)
        self._mark("worker-killed", f"process {victim.spec['proc']} ({count} producers) SIGKILLed, process "
                                    f"{replacement.spec['proc']} with {count} new producers started")

    def drain_worker(self) -> None:
        p = self.phase
        leaver = next(w for w in p.active if w not in p.workers[-1:])  # not the one just started
        p.active.remove(leaver)
        leaver.proc.send_signal(signal.SIGTERM)
        p.drained.append(leaver)
        count = int(leaver.spec["count"])
        self._leave(count, self._live())
        self._mark("worker-drained", f"process {leaver.spec['proc']} ({count} producers) sent SIGTERM")

    # -- figures ---------------------------------------------------------------------------------

    def figures(self, lag: list[tuple[float, int]], steps: list[tuple[float, int, int]], t1: float,
                origin: float, *, across: list[tuple[float, int]] = (), failed_at: list[float] = ()
                ) -> dict[str, Any]:
        s = self.phase.spec
        steady = s.in_flight_bound
        edges = [e.t for e in self.events] + [t1]
        base = [t for t, _, _ in steps if edges[0] <= t < edges[1]]
        base_rate = len(base) / (edges[1] - edges[0])
        segments = []
        over_bound = []
        for i, event in enumerate(self.events):
            start, end = edges[i], edges[i + 1]
            inside = [(t, v) for t, v in lag if start <= t < end]
            over_bound += [(round(t - origin, 2), v, event.bound) for t, v in inside if v > event.bound]
            values = [v for _, v in inside] or [0]
            seg: dict[str, Any] = {
                "event": event.name, "detail": event.detail, "at_s": round(event.t - origin, 2),
                "seconds": round(end - start, 1), "producers_alive": event.live, "producers_left": event.leavers,
                "bound": event.bound, "lag_max": max(values), "lag_samples": len(inside),
                # reads while a commit was under way (the lag against the offsets before it: at most a step high)
                "lag_max_during_commits": max([v for t, v in across if start <= t < end], default=None),
                "lag_samples_during_commits": sum(1 for t, _ in across if start <= t < end),
                "lag_reads_failed": sum(1 for t in failed_at if start <= t < end),
                "longest_unsampled_s": _longest_gap([t for t, _ in inside], start, end),
                "over_max_lag_fraction": _fraction(inside, s.max_lag),
                "longest_over_max_lag_s": _longest(inside, s.max_lag),
                "over_steady_bound_fraction": _fraction(inside, steady),
                "longest_over_steady_bound_s": _longest(inside, steady),
                "within_steady_bound_after_s": _settled(inside, steady, start),
                "steps_per_s": round(sum(1 for t, _, _ in steps if start <= t < end) / (end - start), 2),
            }
            if i > 0:
                seg.update(_recovery(steps, start, end, base_rate))
            segments.append(seg)
        in_window = [v for t, v in lag if edges[0] <= t <= t1] or [0]
        return {"events": segments, "baseline_steps_per_s": round(base_rate, 2), "rate_window_s": RATE_WINDOW_S,
                "recovered_at": RECOVERED, "steady_bound": steady, "bound_max": max(e.bound for e in self.events),
                "lag_max": max(in_window), "over_bound": over_bound[:50], "within_bound": not over_bound,
                "bound_series": [(round(e.t - origin, 2), e.bound) for e in self.events] + [
                    (round(t1 - origin, 2), self.events[-1].bound)]}


def _longest_gap(times: list[float], start: float, end: float) -> float:
    edges = [start, *times, end]
    return round(max(b - a for a, b in zip(edges, edges[1:], strict=False)), 1)


def _fraction(samples: list[tuple[float, int]], limit: int) -> float:
    return round(sum(v > limit for _, v in samples) / len(samples), 3) if samples else 0.0


def _longest(samples: list[tuple[float, int]], limit: int) -> float:
    """The longest stretch of consecutive samples over `limit`, in seconds (first to last sample of it)."""
    best, since = 0.0, None
    for t, v in samples:
        if v > limit:
            since = t if since is None else since
            best = max(best, t - since)
        else:
            since = None
    return round(best, 2)


def _settled(samples: list[tuple[float, int]], limit: int, start: float) -> float | None:
    """Seconds from `start` to the first sample from which every later one is within `limit` (None: never)."""
    last_over = None
    for t, v in samples:
        if v > limit:
            last_over = t
    if last_over is None:
        return 0.0
    later = [t for t, _ in samples if t > last_over]
    return round(later[0] - start, 2) if later else None


def _recovery(steps: list[tuple[float, int, int]], start: float, end: float, base_rate: float) -> dict[str, Any]:
    """From `start`, the first t whose next RATE_WINDOW_S holds >= RECOVERED x base_rate steps/s; the lowest rate."""
    times = [t for t, _, _ in steps]

    def rate(t: float) -> float:
        return sum(1 for x in times if t <= x < t + RATE_WINDOW_S) / RATE_WINDOW_S

    probes = [start + 0.5 * k for k in range(int((end - start - RATE_WINDOW_S) / 0.5) + 1)] or [start]
    rates = [rate(t) for t in probes]
    recovered = next((t - start for t, r in zip(probes, rates, strict=True) if r >= RECOVERED * base_rate), None)
    return {"recovered_after_s": None if recovered is None else round(recovered, 1),
            "lowest_steps_per_s": round(min(rates), 2)}


def render(phase: dict[str, Any]) -> list[str]:
    """Lines for the text report: per event, the bound, the lag, and throughput recovery."""
    c = phase["churn"]
    lines = ["", f"{phase['label']} under churn: baseline {c['baseline_steps_per_s']:.2f} steps/s; steady bound "
             f"(max_lag + in flight) {c['steady_bound']}; recovered = the next {c['rate_window_s']:g} s at >= "
             f"{c['recovered_at']:.0%} of the baseline's steps/s",
             f"{'event':<16}{'at s':>7}{'alive':>6}{'left':>5}{'bound':>6}{'lag max':>8}{'>max_lag':>9}"
             f"{'longest':>8}{'>steady':>8}{'longest':>8}{'back s':>7}{'steps/s':>8}{'lowest':>7}{'recov s':>8}"
             f"{'samples':>8}{'gap s':>6}{'in-commit max':>14}"]
    for e in c["events"]:
        back = e["within_steady_bound_after_s"]
        rec = e.get("recovered_after_s", "-")
        lines.append(f"{e['event']:<16}{e['at_s']:>7.1f}{e['producers_alive']:>6}{e['producers_left']:>5}"
                     f"{e['bound']:>6}{e['lag_max']:>8}{e['over_max_lag_fraction']:>9.0%}"
                     f"{e['longest_over_max_lag_s']:>8.1f}{e['over_steady_bound_fraction']:>8.0%}"
                     f"{e['longest_over_steady_bound_s']:>8.1f}{'never' if back is None else back:>7}"
                     f"{e['steps_per_s']:>8.2f}{e.get('lowest_steps_per_s', '-'):>7}"
                     f"{'never' if rec is None else rec:>8}{e['lag_samples']:>8}{e['longest_unsampled_s']:>6.1f}"
                     f"{'-' if e['lag_max_during_commits'] is None else e['lag_max_during_commits']:>14}")
    for e in c["events"]:
        if e["detail"]:
            lines.append(f"  {e['event']}: {e['detail']}")
    lines.append("  >max_lag / >steady: share of lag samples over max_lag / over max_lag + in flight, longest: the "
                 "longest stretch (s); back s: from the event until within max_lag + in flight for good; samples: lag "
                 "samples between commits, gap s: the longest time without one, in-commit max: the highest read taken "
                 "while a commit was under way (against the offsets before it: at most a step too high)")
    lines.append(f"  lag max {c['lag_max']} against a bound of at most {c['bound_max']}: "
                 + ("within it throughout" if c["within_bound"] else f"OVER at {c['over_bound'][:5]}"))
    return lines
