"""The producer state that prompt intake's commits carry, and its commits after a lag gate change.

Contract:
- Every commit of intake carries this producer's state (`rollstream.infra.producer_state.ProducerState`) as the offsets'
  metadata (`StateCommits.metadata`).
- When the lag gate opens or closes, the known offsets are committed again with the new state (at most once
  per `_STATE_COMMIT_S`), so `rollstream status` sees a paused producer within about a second. Known means
  contiguous (`Watermarks.known`): nothing is ever skipped; a partition with nothing known yet is left out
  (its first commit will carry the state).

`StateCommits` belongs to the intake thread (`rollstream.producers.intake`); it reads the gate with its
thread-safe `is_open`.
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer
from rollstream.infra.producer_state import ProducerState
from rollstream.producers._watermarks import Watermarks, commit_partitions
from rollstream.producers.gate import LagGate
from rollstream.schemas import now_ms

log = logging.getLogger(__name__)
_STATE_COMMIT_S = 1.0  # at most one commit per this long only to publish a changed gate state


class StateCommits:
    """The gate state producer `producer_id`'s intake last saw, and when it was last committed."""

    def __init__(self, producer_id: str, gate: LagGate) -> None:
        self.producer_id = producer_id
        self._gate = gate
        self._paused: bool | None = None  # None before the first look
        self._since_ms = now_ms()
        self.stale = False  # the gate changed since the state was last committed
        self._committed_at = 0.0

    def state(self) -> ProducerState:
        """This producer's state as the intake thread last saw the gate (what the next commit carries)."""
        return ProducerState(producer_id=self.producer_id, paused=bool(self._paused),
                             since_ms=self._since_ms, max_lag=self._gate.max_lag, updated_at_ms=now_ms(),
                             trainer_group=self._gate.trainer_group)

    def metadata(self) -> str:
        """`state` as a commit's metadata."""
        return self.state().to_metadata()

    def watch(self) -> None:
        """Note when the lag gate opened or closed (read each turn; `is_open` is a thread-safe read)."""
        paused = not self._gate.is_open()
        if paused != self._paused:
            self._paused, self._since_ms = paused, now_ms()
            self.stale = True

    def commit(self, consumer: Consumer, topic: str, group_id: str, marks: Watermarks) -> None:
        """After a gate change, commit every partition's known offset of `marks` again with the new state, at
        most once per `_STATE_COMMIT_S` (see the module docstring). Blocks (a commit)."""
        if not self.stale or time.monotonic() - self._committed_at < _STATE_COMMIT_S:
            return
        self._committed_at = time.monotonic()
        offsets = marks.known()
        failed = commit_partitions(consumer, topic, group_id, offsets, metadata=self.metadata())
        marks.mark_committed({p: o for p, o in offsets.items() if p not in failed})
        self.stale = bool(failed)  # retried after _STATE_COMMIT_S
        if offsets and not failed:
            log.info("producer %s %s (lag gate): state committed with %s offsets %s", self.producer_id,
                     "paused" if self._paused else "running", topic, offsets)
