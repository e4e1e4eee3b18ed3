"""Prometheus metrics of one trainer consumer, in a registry of its own (never the global one)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from consumers.filters import reason_label, staleness_of

if TYPE_CHECKING:
    from consumers._batch import Batch

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
        self.take_seconds = Histogram("rollstream_consumer_take_seconds", "Wall time of one take(n) call.",
                                      buckets=_TAKE_BUCKETS, registry=r)
        self.groups_taken = Counter("rollstream_consumer_groups_taken", "Groups handed to the trainer.", registry=r)
        self.bytes_taken = Counter("rollstream_consumer_bytes_taken", "Encoded bytes of the groups taken.",
                                   registry=r)
        self.groups_filtered = Counter("rollstream_consumer_groups_filtered", "Groups skipped by a filter.",
                                       ["reason"], registry=r)
        self.groups_requeued = Counter("rollstream_consumer_groups_requeued",
                                       "Groups skipped for a passing reason whose prompt was published again "
                                       "(labelled by that reason; see consumers._requeue).", ["reason"], registry=r)
        self.duplicates = Counter("rollstream_consumer_groups_duplicate",
                                  "Groups skipped because their group_id was already taken.", registry=r)
        self.undecodable = Counter("rollstream_consumer_records_undecodable",
                                   "Records on the rollouts topic that are not a decodable ScoredGroup.", registry=r)
        self.lag = Gauge("rollstream_consumer_lag_records",
                         "Records on the rollouts topic after the trainer's position (from the last fetch).",
                         registry=r)
        self.staleness = Histogram("rollstream_consumer_group_staleness_versions",
                                   "Trainer policy version minus the oldest weight version of each taken group.",
                                   buckets=_STALENESS_BUCKETS, registry=r)
        self.step = Gauge("rollstream_consumer_step", "Number of the last step taken.", registry=r)
        self.steps_committed = Counter("rollstream_consumer_steps_committed",
                                       "Steps whose manifest and offsets were committed.", registry=r)
        self.client_replacements = Counter("rollstream_consumer_client_replacements",
                                           "Kafka clients replaced after repeated failed commits (a client that "
                                           "lost its group coordinator).", registry=r)

    def observe_step(self, batch: Batch, seconds: float, taken_bytes: int, policy_version: int | None,
                     lag: int) -> None:
        """Record one take: its latency, what happened to each offset, staleness of each taken group."""
        self.take_seconds.observe(seconds)
        self.groups_taken.inc(len(batch.groups))
        self.bytes_taken.inc(taken_bytes)
        self.step.set(batch.step)
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
