"""Producer observability: Prometheus metrics on a registry of the producer's own, and the loop-lag probe.

No global default registry: two producers in one process (tests, a multi-engine host) never clash.
`serve` exposes the registry over HTTP (``--metrics-port``). The event-loop lag probe is a task that
sleeps a fixed interval and records how late it wakes: the direct measure of anything blocking the loop.

Names follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/): base units
(seconds, bytes) last, counters end in ``_total``, a gauge of a count names what it counts (groups,
prompts, records). No sentinel values: ``rollstream_producer_weight_version`` is absent from the
scrape until the engine reports a version. Label values from a closed set (``status``, ``source``,
``change``) are initialised at zero, so a rate over them exists before the first event. docs/metrics.md
lists every name and the renames; ``infra/grafana/rollstream.json`` is the dashboard.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from rollstream.schemas.records import GroupStatus

_LOOP_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LATENCY_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_GROUP_STATUSES = get_args(GroupStatus)  # ok, failed
_LAG_SOURCES = ("pushed", "read")  # rollstream.producers.gate
_PARTITION_CHANGES = ("assigned", "revoked", "lost")  # rollstream.producers.intake


@dataclass(frozen=True)
class ProducerStats:
    """A snapshot of a producer's counters (see `RolloutProducer.stats`)."""

    prompts_taken: int
    groups_ok: int
    groups_failed: int
    bytes_published: int
    in_flight: int
    buffered: int
    paused: bool
    lag_estimate: int
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    queue_full_waits: int = 0

    @property
    def groups_published(self) -> int:
        return self.groups_ok + self.groups_failed

    def summary(self) -> str:
        """The periodic one-line log summary."""
        return (f"published={self.groups_published} (failed {self.groups_failed}) taken={self.prompts_taken} "
                f"in_flight={self.in_flight} buffered={self.buffered} lag~{self.lag_estimate} "
                f"paused={'yes' if self.paused else 'no'} loop_lag_p99={self.loop_lag_p99_ms:.1f}ms")


@dataclass
class Tally:
    """The plain counts behind `ProducerStats` (ints written on the loop, read from any thread)."""

    prompts_taken: int = 0
    groups_ok: int = 0
    groups_failed: int = 0
    bytes_published: int = 0
    queue_full_waits: int = 0


class ProducerMetrics:
    """Every metric of one producer, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "rollstream_producer_"
        self.in_flight = Gauge(p + "in_flight_groups", "Groups being generated, scored or published.", registry=r)
        self.buffered = Gauge(p + "buffered_prompts", "Prompts taken and waiting for a generation slot.", registry=r)
        self.paused = Gauge(p + "paused", "1 while intake is paused by backpressure (trainer lag).", registry=r)
        self.lag = Gauge(p + "trainer_lag_records", "Trainer lag on the rollouts topic (records), as the gate "
                         "estimates it.", registry=r)
        self.share = Gauge(p + "lag_share_records", "This producer's share of the fleet's max_lag (records): it "
                           "starts no prompt while its own outstanding groups exceed it.", registry=r)
        self.outstanding = Gauge(p + "outstanding_records", "Records this producer published (or is publishing) "
                                 "that the trainer group has not committed yet, as far as it knows.", registry=r)
        self.lag_updates = Counter(p + "lag_updates_total", "Trainer lag updates the gate applied, by source: the "
                                   "trainer's pushed position on NS.control, or the gate's own read.", ["source"],
                                   registry=r)
        self.prompts = Counter(p + "prompts_taken_total", "Prompts taken from the prompts topic.", registry=r)
        self.groups = Counter(p + "groups_published_total", "Groups acknowledged by the broker, by status.",
                              ["status"], registry=r)
        self.bytes = Counter(p + "published_bytes_total", "Bytes of groups acknowledged by the broker.", registry=r)
        self.queue_full = Counter(p + "queue_full_waits_total", "Produces that waited off-loop for room in "
                                  "librdkafka's queue.", registry=r)
        self.client_replacements = Counter(p + "client_replacements_total", "Kafka clients replaced because they "
                                           "stopped working (librdkafka#5511), by role: intake (the prompt "
                                           "consumer) or lag (the gate's lag reader).", ["role"], registry=r)
        for role in ("intake", "lag"):  # each series from 0, so a rate is defined before the first replacement
            self.client_replacements.labels(role)
        self.orphan_rejoins = Counter(p + "orphan_rejoins_total", "Times this producer left the prompt group and "
                                      "joined again because partitions were assigned to no member of the stable "
                                      "group (a cooperative rebalance left half done).", registry=r)
        self.rebalances = Counter(p + "rebalances_total", "Changes to the prompt partitions this producer owns, one "
                                  "per change that moved at least one partition (not per partition), by change: "
                                  "assigned, revoked (drained and given up in a rebalance), lost (dropped without a "
                                  "revocation: session expired, or the intake client replaced).", ["change"],
                                  registry=r)
        for change in _PARTITION_CHANGES:
            self.rebalances.labels(change)
        self.assigned_partitions = Gauge(p + "assigned_partitions", "Prompt partitions this producer owns now "
                                         "(the prompt group's assignment, as intake last learned it).", registry=r)
        self.generation = Histogram(p + "generation_seconds", "Generation plus scoring time of a group.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.publish = Histogram(p + "publish_seconds", "Produce-to-acknowledgement time of a group.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "How late the event loop runs a timer.",
                                  buckets=_LOOP_LAG_BUCKETS, registry=r)
        # Registered on the first known version (`show_weight_version`): absent beats a -1 sentinel, which
        # max() and alerts would take for a real version.
        self._weight_version = Gauge(p + "weight_version", "Policy version of the weights the engine serves "
                                     "(engines that load announced weights; absent until one is known).",
                                     registry=None)
        self._weight_version_shown = False
        self.weight_reloads = Counter(p + "weight_reloads_total", "Announced policy versions loaded into the "
                                      "engine, by result (loaded, failed).", ["result"], registry=r)
        self.superseded_announcements = Counter(
            p + "superseded_announcements_total", "Policy versions announced by a superseded trainer run, which "
            "moved nothing (a trainer that was replaced and still announces).", registry=r)
        self.policy_run = Gauge(p + "policy_run", "The trainer run whose policy versions the producer follows "
                                "(0: announced before runs existed, or nothing announced).", registry=r)
        self.checkpoints = Counter(p + "checkpoints_total", "In-flight checkpoints on NS.inflight, by result: written "
                                   "(acknowledged), failed (not acknowledged: a newer one follows, or the sample is "
                                   "generated again), tombstoned (its group published).", ["result"], registry=r)
        self.checkpoint_bytes = Counter(p + "checkpoint_bytes_total", "Bytes of in-flight checkpoints written.",
                                        registry=r)
        self.resumed = Counter(p + "resumed_samples_total", "Samples of a prompt taken over that had a checkpoint, "
                               "by what became of it: continued, kept (it had finished), restarted (the engine "
                               "could not resume it), discarded (another trainer run, or older than "
                               "--checkpoint-max-staleness).", ["how"], registry=r)
        self.resumed_tokens = Counter(p + "resumed_tokens_total", "Tokens taken from checkpoints rather than "
                                      "generated again.", registry=r)
        for result in ("written", "failed", "tombstoned"):
            self.checkpoints.labels(result)
        for how in ("continued", "kept", "restarted", "discarded"):
            self.resumed.labels(how)
        self._groups_by_status = {status: self.groups.labels(status=status) for status in _GROUP_STATUSES}
        for source in _LAG_SOURCES:
            self.lag_updates.labels(source=source)
        self._http: tuple[Any, threading.Thread] | None = None
        self.tally = Tally()

    # What `stats()` reports is counted here beside the Prometheus series, so nothing reads a metric back
    # by its name. Each is called on the event loop.

    def count_prompt(self, count: int = 1) -> None:
        self.prompts.inc(count)
        self.tally.prompts_taken += count

    def count_published(self, status: str, nbytes: int, seconds: float) -> None:
        self.publish.observe(seconds)
        self._groups_by_status[status].inc()
        self.bytes.inc(nbytes)
        self.tally.bytes_published += nbytes
        if status == "ok":
            self.tally.groups_ok += 1
        else:
            self.tally.groups_failed += 1

    def show_weight_version(self, version: int) -> None:
        """Expose the policy version the engine serves (from the first call on). Loop only; never blocks."""
        self._weight_version.set(version)
        if not self._weight_version_shown:
            self.registry.register(self._weight_version)
            self._weight_version_shown = True

    def count_partition_change(self, change: str, partitions: int, owned: int) -> None:
        """`partitions` prompt partitions were assigned, revoked or lost (`change`), leaving `owned`: one change
        counted when any moved (a rebalance callback with nothing for this producer counts none). Any thread."""
        if partitions:
            self.rebalances.labels(change).inc()
        self.assigned_partitions.set(owned)

    def count_queue_full(self) -> None:
        self.queue_full.inc()
        self.tally.queue_full_waits += 1

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on `port` (0: any free port) in a daemon thread; return the bound port."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        return int(server.server_port)

    def close(self) -> None:
        """Stop the HTTP server, if any. Idempotent."""
        if self._http is not None:
            server, _ = self._http
            self._http = None
            server.shutdown()
            server.server_close()


class LoopLagProbe:
    """Measures event-loop lag: sleep `interval_s`, record how much later than asked the loop woke."""

    def __init__(self, histogram: Histogram | None = None, *, interval_s: float = 0.01, window: int = 10_000) -> None:
        self._histogram = histogram
        self._interval_s = interval_s
        self._samples: collections.deque[float] = collections.deque(maxlen=window)

    async def run(self) -> None:
        """Run until cancelled."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self._interval_s)
            lag = max(0.0, time.perf_counter() - start - self._interval_s)
            self._samples.append(lag)
            if self._histogram is not None:
                self._histogram.observe(lag)

    def reset(self) -> None:
        self._samples.clear()

    def percentile_ms(self, q: float) -> float:
        """The q-quantile (0..1) of the recorded lags, in milliseconds (0 when nothing recorded)."""
        data = sorted(self._samples)
        if not data:
            return 0.0
        index = min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))
        return data[index] * 1000.0

    def max_ms(self) -> float:
        return max(self._samples, default=0.0) * 1000.0
