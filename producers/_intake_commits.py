"""Prompt intake's offset commits: sent asynchronously by the intake thread, answered inside its own polls.

Contract:
- At most one commit is in flight. At each `tick` (every turn of the intake thread) the answer to the one in
  flight is read, and the next one is sent when due: after a lag gate change the known offsets with the new
  state (`StateCommits.due`), else, every ``interval_s``, the watermarks that moved (`Watermarks.committable`).
  Every commit carries the producer's state as its metadata. A partition is marked committed only once the
  broker accepted it; a refused one is sent again at a later tick; a fatal error is raised.
- Sending never blocks (``consumer.commit(asynchronous=True)``): librdkafka hands the answer to the client's
  ``on_commit`` (`conf`, given when the client is opened) inside the intake thread's next poll. A synchronous
  commit instead waits for the coordinator with no deadline, and a client that lost its coordinator for good
  (confluentinc/librdkafka#5511) would hold the intake thread, and with it every prompt, for ever.
- A commit with no answer within ``answer_s`` makes `tick` return False: the client is to be replaced
  (`rollstream.producers._intake_stall`), and `forget` drops what the old client still owes.
- `final` (at close) sends the last watermarks and polls for their answer, within a bound.

`IntakeCommits` belongs to the intake thread (`rollstream.producers.intake`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from confluent_kafka import Consumer
from rollstream.infra.commits import CommitAnswers, CommitKey, raise_failures
from rollstream.infra.deadline import Deadline
from rollstream.infra.kafka_errors import CommitFailed
from rollstream.producers._intake_state import StateCommits
from rollstream.producers._watermarks import Watermarks

log = logging.getLogger(__name__)
_FINAL_POLL_S = 0.05


@dataclass(frozen=True)
class _Sent:
    key: CommitKey
    offsets: dict[int, int]
    at: float
    change: int | None  # the gate change a state commit carries (None: a watermark commit)


class IntakeCommits:
    """The commits of one intake (see the module docstring): `tick` each turn, `final` at close."""

    def __init__(self, topic: str, group_id: str, marks: Watermarks, state: StateCommits, *, interval_s: float,
                 answer_s: float) -> None:
        self._topic, self._group_id, self._marks, self._state = topic, group_id, marks, state
        self._interval_s, self._answer_s = interval_s, answer_s
        self._answers = CommitAnswers()
        self._sent: _Sent | None = None  # the commit in flight
        self._last_sent = 0.0

    def conf(self) -> dict[str, object]:
        """The consumer property that routes the intake client's commit answers here."""
        return self._answers.conf()

    def tick(self, consumer: Consumer) -> bool:
        """Read the answer to the commit in flight; send the next one when due. Never blocks.

        Returns False when the commit in flight got no answer within ``answer_s`` (replace the client).
        Raises CommitFailed when librdkafka calls a failure fatal.
        """
        if self._sent is not None and not self._collect():
            waited = time.monotonic() - self._sent.at
            if waited < self._answer_s:
                return True
            log.warning("commit of %s offsets %s for group %s got no answer from the group coordinator in %.0f s",
                        self._topic, self._sent.offsets, self._group_id, waited)
            self._sent = None
            return False
        if self._state.due():
            change = self._state.sent()
            offsets = self._marks.known()
            if not offsets:
                self._state.accepted(change, offsets)  # nothing to carry it yet: the first commit will
            self._send(consumer, offsets, change)
        elif time.monotonic() - self._last_sent >= self._interval_s:
            self._send(consumer, self._marks.committable(), None)
        return True

    def forget(self) -> None:
        """The client was replaced: the answer its commit in flight may still get says nothing about the new one."""
        self._sent = None

    def final(self, consumer: Consumer, wait_s: float) -> None:
        """Send the last watermarks that moved and poll `consumer` for their answer, at most `wait_s` (a commit
        in flight is answered first). Blocks up to `wait_s` plus one poll (50 ms). A record a poll hands out is
        left uncommitted (its next owner takes it). What is not committed then, the next owner takes again.
        Raises CommitFailed when librdkafka calls a failure fatal."""
        deadline = Deadline.after(wait_s)
        final_sent = False
        while not deadline.expired:
            if self._sent is not None and not self._collect():
                consumer.poll(min(_FINAL_POLL_S, deadline.remaining()))  # serves the answer (on_commit)
                continue
            if final_sent:
                return
            self._send(consumer, self._marks.committable(), None)
            final_sent = True
            if self._sent is None:
                return
        log.warning("the last commit of %s offsets for group %s got no answer in %g s: what it did not commit, "
                    "the next owner takes again", self._topic, self._group_id, wait_s)

    def _send(self, consumer: Consumer, offsets: dict[int, int], change: int | None) -> None:
        if not offsets:
            return
        self._last_sent = time.monotonic()
        try:
            key = self._answers.send(consumer, self._topic, offsets, metadata=self._state.metadata())
        except CommitFailed as exc:
            if exc.fatal:
                raise
            log.warning("commit of %s offsets %s for group %s not sent (will retry): %s", self._topic, offsets,
                        self._group_id, exc)
            return
        self._sent = _Sent(key, dict(offsets), self._last_sent, change)

    def _collect(self) -> bool:
        """Apply the answer to the commit in flight, if it came; whether it did (False with none in flight)."""
        sent = self._sent
        if sent is None:
            return False
        answer = self._answers.answer(sent.key)
        if answer is None:
            return False
        self._sent = None
        failed: dict[int, int] = {}
        try:
            raise_failures(self._topic, sent.offsets, *answer)
        except CommitFailed as exc:
            if exc.fatal:
                raise
            failed = {p: sent.offsets[p] for p in exc.failed if p in sent.offsets}
            for p, offset in sorted(failed.items()):
                log.warning("commit of %s[%d]@%d for group %s failed (will retry): %s", self._topic, p, offset,
                            self._group_id, exc.failed[p])
        self._marks.mark_committed({p: o for p, o in sent.offsets.items() if p not in failed})
        if not failed:
            log.debug("committed %s offsets %s for group %s", self._topic, sent.offsets, self._group_id)
            if sent.change is not None:
                self._state.accepted(sent.change, sent.offsets)
        return True
