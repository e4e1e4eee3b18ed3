"""The producer state that prompt intake's commits carry, and its commits after a lag gate change.

Contract:
- Every commit of intake carries this producer's state (`rollstream.infra.producer_state.ProducerState`) as the offsets'
  metadata (`StateCommits.metadata`).
- When the lag gate opens or closes, the known offsets are to be committed again with the new state (`due`, at
  most once per `_STATE_COMMIT_S`; `rollstream.producers._intake_commits` sends them), so `rollstream status`
  sees a paused producer within about a second. Known means contiguous (`Watermarks.known`): nothing is ever
  skipped; a partition with nothing known yet is left out (its first commit will carry the state).

`StateCommits` belongs to the intake thread (`rollstream.producers.intake`); it reads the gate with its
thread-safe `is_open`.
"""

from __future__ import annotations

import logging
import time

from rollstream.infra.producer_state import ProducerState
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
        self._changes = 0  # gate changes seen
        self._accepted = 0  # the last change a commit carried that the broker accepted
        self._sent_at = 0.0

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
            self._changes += 1

    def due(self) -> bool:
        """Whether the known offsets are to be committed again now, only to carry a changed gate state: the gate
        changed since the state was last accepted, and the last such commit is `_STATE_COMMIT_S` old."""
        return self._changes != self._accepted and time.monotonic() - self._sent_at >= _STATE_COMMIT_S

    def sent(self) -> int:
        """A commit carrying the state was just sent; returns the change it carries (for `accepted`)."""
        self._sent_at = time.monotonic()
        return self._changes

    def accepted(self, change: int, offsets: dict[int, int]) -> None:
        """The broker accepted the commit that carried `change` (with `offsets`, maybe none)."""
        self._accepted = change
        if offsets:
            log.info("producer %s %s (lag gate): state committed with offsets %s", self.producer_id,
                     "paused" if self._paused else "running", offsets)
