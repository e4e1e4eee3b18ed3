"""The TRL worker thread's side of `rollstream.consumers.trl`: the hand-over queue TRL reads, and what the thread owns.

`HandOver` is the worker's ``rollout_buffer``: TRL reads it from the trainer's thread and it counts what was
read (and what TRL drops as stale), so a commit knows whether the step it commits was trained whole.
`Pipeline` is everything the ``rollstream-trl`` thread owns (not thread-safe): the `RolloutConsumer`, the
`PolicyAnnouncer`, and the batches handed to TRL and not committed yet, oldest first. It takes one step's
groups in slices of ``poll_interval_s``, commits the oldest handed-over batch when TRL's optimizer step
trained it, and announces versions. The contract both keep is `rollstream.consumers.trl`'s.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollstream.consumers._adapters import StepMetrics, group_size_filter
from rollstream.consumers._batch import Batch
from rollstream.consumers._consumer import RolloutConsumer
from rollstream.consumers._trl_samples import to_rollout_samples, trainable
from rollstream.consumers.filters import default_filters
from rollstream.infra import KafkaConfig, PolicyAnnouncer, TopicNames
from rollstream.schemas import PolicyVersion, RollstreamError

if TYPE_CHECKING:
    from rollstream.consumers.trl import StepShape, TRLWorkerSettings

log = logging.getLogger(__name__)
Metrics = dict[str, float | tuple[float, float]]



class HandOver(queue.Queue[Any]):
    """The rollout buffer: counts what TRL drained and mirrors TRL's stale drop (async_grpo_trainer.py:366-372).

    Unbounded on purpose: the worker never puts more than `prefetch_steps` batches in it. TRL reads it
    with the public `get` (async_grpo_trainer.py:356), which this counts in, in the trainer's thread,
    right before TRL reads its model version (the same value `update_model_version` gave us, set in that
    thread). The trainer's thread asks for a commit only after that `get` returned, so a commit sees it.
    """

    def __init__(self, version: Callable[[], int], max_staleness: int) -> None:
        super().__init__()
        self._version = version
        self._max_staleness = max_staleness
        self._counted = threading.Lock()  # the trainer's thread counts, the worker's reads the counts
        self._drained = 0
        self._dropped: list[str] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """`queue.Queue.get`, counted (and a sample TRL will drop as stale noted)."""
        sample = super().get(block, timeout)
        staleness = self._version() - sample.model_version
        with self._counted:
            self._drained += 1
            if staleness > self._max_staleness:
                self._dropped.append(f"group {sample.group_id} (staleness {staleness})")
        return sample

    def counts(self) -> tuple[int, list[str]]:
        """(samples read so far, the ones TRL dropped as stale)."""
        with self._counted:
            return self._drained, list(self._dropped)


@dataclass(frozen=True)
class _Handed:
    batch: Batch
    through: int  # samples handed to TRL up to and including this batch


class Pipeline:
    """What the worker thread owns: the consumer, the announcer, the batches handed to TRL (oldest first)."""

    def __init__(self, settings: TRLWorkerSettings, shape: StepShape, kafka: KafkaConfig, buffer: HandOver,
                 push: Callable[[Metrics], None]) -> None:
        s = self._settings = settings
        self._shape, self._buffer, self._push = shape, buffer, push
        filters = (*default_filters(dynamic_sampling=s.dynamic_sampling),
                   group_size_filter(shape.num_generations, trainer="TRL", setting="num_generations"), trainable)
        # One trainer run (rollstream.infra.runs): TRL counts versions from 1 again in every run, so producers
        # must follow this run's versions down, and a replaced worker must neither announce nor commit.
        self.announcer = PolicyAnnouncer(kafka, TopicNames(s.namespace))
        self.consumer = RolloutConsumer(config=kafka, group_id=s.group, namespace=s.namespace,
                                        filters=filters, max_staleness=shape.max_staleness, timeout=s.kafka_timeout_s,
                                        announcer=self.announcer)
        self.handed: deque[_Handed] = deque()
        self._samples = 0
        self._waiting_since: float | None = None
        self._logged_wait = 0.0

    @property
    def full(self) -> bool:
        return len(self.handed) >= self._settings.prefetch_steps

    def take_slice(self, version: int) -> bool:
        """Wait for one step's groups for at most one poll interval (`RolloutConsumer.poll_batch`: no error,
        no cluster read); True when a batch was handed over.

        Raises:
            TakeTimeout: ``take_timeout_s`` passed since this step's wait began (diagnosed once, then).
        """
        n, now = self._shape.groups_per_step, time.monotonic()
        self._waiting_since = self._waiting_since or now
        limit = self._settings.take_timeout_s
        wait = self._settings.poll_interval_s
        if limit is not None:
            wait = max(0.0, min(wait, self._waiting_since + limit - now))
        batch = self.consumer.poll_batch(n, wait, commit=False, policy_version=version)
        if batch is None:
            self._note_wait()
            return False
        samples: list[Any] = []
        for g in batch.groups:  # a group's TRL version: its oldest weight version, else the one it was taken at
            oldest = g.oldest_weight_version
            samples += to_rollout_samples(g, model_version=version if oldest is None else oldest)
        if len(samples) != self._shape.samples_per_step:
            raise RollstreamError(f"step {batch.step}: {len(samples)} samples, a TRL step needs "
                                  f"{self._shape.samples_per_step}")
        for sample in samples:
            sample.enqueued_at = time.time()
            self._buffer.put_nowait(sample)
        self._samples += len(samples)
        self.handed.append(_Handed(batch, self._samples))
        self._push(take_metrics(batch, version, self.consumer.estimated_lag(), time.monotonic() - self._waiting_since))
        log.info("step %d handed to TRL: %d groups, %d samples at policy version %d (%d handed ahead)",
                 batch.step, len(batch.groups), len(samples), version, len(self.handed))
        self._waiting_since, self._logged_wait = None, 0.0
        return True

    def _note_wait(self) -> None:
        waited = time.monotonic() - (self._waiting_since or time.monotonic())
        limit = self._settings.take_timeout_s
        if limit is not None and waited >= limit:
            raise self.consumer.timeout_error(self._shape.groups_per_step, limit)
        if waited - self._logged_wait >= 30.0:
            self._logged_wait = waited
            log.info("waiting %.0f s for %d groups on %s (%d records buffered); are producers running? `rollstream "
                     "status --namespace %s --group %s`", waited, self._shape.groups_per_step,
                     self.consumer.names.rollouts, self.consumer.buffered(), self._settings.namespace,
                     self._settings.group)

    def commit_oldest(self, trl_step: int) -> int:
        """Commit the oldest handed-over batch, which TRL's optimizer step `trl_step` just trained."""
        if not self.handed:
            raise RollstreamError(f"TRL finished step {trl_step} but no rollstream batch was handed over")
        handed = self.handed[0]
        drained, dropped = self._buffer.counts()
        if dropped:
            raise RollstreamError(f"TRL dropped {len(dropped)} sample(s) as stale ({dropped[0]}, max_staleness="
                                  f"{self._shape.trl_max_staleness}), so step "
                                  f"{handed.batch.step} was not trained whole; nothing committed. Lower "
                                  "TRLWorkerSettings.max_staleness or raise TRL's max_staleness")
        if drained < handed.through:
            raise RollstreamError(f"TRL finished step {trl_step} after reading {drained} samples, fewer than the "
                                  f"{handed.through} handed over through rollstream step {handed.batch.step}: its "
                                  f"steps are not {self._shape.samples_per_step} samples; nothing committed")
        started = time.monotonic()
        self.consumer.commit(handed.batch)
        self.handed.popleft()
        self._push({"rollstream/commit_s": time.monotonic() - started})
        log.info("TRL step %d trained rollstream step %d: committed", trl_step, handed.batch.step)
        return handed.batch.step

    def announce(self, version: int) -> None:
        path = self._settings.weights_path
        self.announcer.announce(PolicyVersion(version, path.format(version=version) if path else None,
                                              metadata={"trainer": "trl.AsyncGRPOTrainer"}),
                                timeout=self._settings.kafka_timeout_s)

    def close(self) -> None:
        self.consumer.close()  # batches handed over and not committed come back to the next run
        self.announcer.close()


def take_metrics(batch: Batch, version: int, lag: int, waited_s: float) -> Metrics:
    """One take, in the shape TRL's `log()` drains (async_grpo_trainer.py:1698-1707; see `_reduce_metric`)."""
    m = StepMetrics.of(batch, version, lag)
    out: Metrics = {"rollstream/lag": float(lag), "rollstream/take_s": waited_s,
                    "rollstream/groups_taken_total": float(m.counts["taken"]),
                    **{f"rollstream/{kind}_total": float(m.counts[kind])
                       for kind in ("filtered", "requeued", "duplicate", "undecodable")},
                    **{f"rollstream/filtered_{label}_total": float(k) for label, k in m.filtered_by_reason.items()}}
    if m.staleness:
        out["rollstream/staleness_mean"] = m.staleness_mean
        out["rollstream/staleness_max"] = float(m.staleness_max)
    return out
