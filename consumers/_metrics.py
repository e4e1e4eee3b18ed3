"""Prometheus metrics of one trainer consumer, in a registry of its own (never the global one).

Names follow Prometheus' conventions (https://prometheus.io/docs/practices/naming/): base units
(seconds, bytes) last, counters end in ``_total``. No sentinel values: ``rollstream_consumer_step`` is
absent until the first step is taken (step numbers start at 0, so a 0 before it would read as a step).
``filtered`` and ``requeued`` reasons are an open set (custom filters add their own), so their series
appear with the first such group. docs/metrics.md lists every name and the renames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from rollstream.consumers.filters import reason_label, staleness_of

if TYPE_CHECKING:
    from rollstream.consumers._batch import Batch

_TAKE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, float("inf"))
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, float("inf"))


class ConsumerMetrics:
    """Counters, gauges and histograms of a `RolloutConsumer`.

    Pass a `CollectorRegistry` to share one registry between several components of a trainer
    process; metric names are prefixed ``rollstream_consumer_`` so they do not collide.
    Expose with ``prometheus_client.start_http_server(port, registry=metrics.registry)``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        c = "rollstream_consumer_"
        self.take_seconds = Histogram(c + "take_seconds", "Wall time of one take(n) call.",
                                      buckets=_TAKE_BUCKETS, registry=r)
        self.groups_taken = Counter(c + "groups_taken_total", "Groups handed to the trainer.", registry=r)
        self.bytes_taken = Counter(c + "taken_bytes_total", "Encoded bytes of the groups taken.", registry=r)
        self.groups_filtered = Counter(c + "groups_filtered_total", "Groups skipped by a filter, by reason.",
                                       ["reason"], registry=r)
        self.groups_requeued = Counter(c + "groups_requeued_total",
                                       "Groups skipped for a passing reason whose prompt was published again "
                                       "(labelled by that reason; see rollstream.consumers._requeue).", ["reason"],
                                       registry=r)
        self.duplicates = Counter(c + "groups_duplicate_total",
                                  "Groups skipped because their group_id was already taken.", registry=r)
        self.undecodable = Counter(c + "records_undecodable_total",
                                   "Records on the rollouts topic that are not a decodable ScoredGroup.", registry=r)
        self.lag = Gauge(c + "lag_records",
                         "Records on the rollouts topic after the trainer's position (from the last fetch).",
                         registry=r)
        self.staleness = Histogram(c + "group_staleness_versions",
                                   "Trainer policy version minus the oldest weight version of each taken group.",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        # Registered with the first step (`observe_step`): steps count from 0, so a 0 before would be a sentinel.
        self.step = Gauge(c + "step", "Number of the last step taken (absent before the first).", registry=None)
        self._step_shown = False
        self.steps_committed = Counter(c + "steps_committed_total",
                                       "Steps whose manifest and offsets were committed.", registry=r)
        self.dedupe_ids = Gauge(c + "dedupe_ids", "Taken group ids dedupe remembers (bounded by the consumer's "
                                "DedupeWindow; ~120 bytes each).", registry=r)
        self.client_replacements = Counter(c + "client_replacements_total",
                                           "Kafka clients replaced after repeated failed commits (a client that "
                                           "lost its group coordinator).", registry=r)

    def observe_commit(self, steps: int, remembered_ids: int) -> None:
        """Record `steps` steps committed, after which dedupe remembers `remembered_ids` group ids."""
        self.steps_committed.inc(steps)
        self.dedupe_ids.set(remembered_ids)

    def observe_step(self, batch: Batch, seconds: float, taken_bytes: int, policy_version: int | None,
                     lag: int) -> None:
        """Record one take: its latency, what happened to each offset, staleness of each taken group."""
        self.take_seconds.observe(seconds)
        self.groups_taken.inc(len(batch.groups))
        self.bytes_taken.inc(taken_bytes)
        self.step.set(batch.step)
        if not self._step_shown:
            self.registry.register(self.step)
            self._step_shown = True
        self.lag.set(lag)
        for d in batch.dispositions:
            if d.kind == "filtered":
                self.groups_filtered.labels(reason=reason_label(d.reason or "")).inc()
            elif d.kind == "requeued":
                self.groups_requeued.labels(reason=reason_label(d.reason or "")).inc()
            elif d.kind == "duplicate":
                self.duplicates.inc()
            elif d.kind == "undecodable":
                self.undecodable.inc()
        for g in batch.groups:
            if (versions_behind := staleness_of(g, policy_version)) is not None:
                self.staleness.observe(versions_behind)
