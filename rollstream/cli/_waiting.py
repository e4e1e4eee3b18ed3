"""A `rollstream take` that waits says so: a line on stderr now and then, with how long, how many groups, and why.

A take without ``--timeout`` waits for ever, and a newcomer whose producers are not running (or whose namespace
has no prompts) would see a silent terminal. So the take waits in slices (`RolloutConsumer.poll_batch`, which
commits nothing and puts back everything it looked at) and, between slices, prints one line with the diagnosis a
timed-out take carries (`RolloutConsumer.timeout_error`: the take's own view and the cluster's, producers and
prompts, read by `rollstream.consumers.forensics` in the background at most every 30 s).

When: first after 30 s (a healthy step takes seconds; by 30 s something is likely wrong, and the diagnosis
reads the cluster at most every 30 s anyway), then with the gap doubling from 60 s up to 5 min (lines at 30 s,
1.5, 3.5, 7.5 min, then every 5 min): a first hint soon, and a take left waiting overnight writes a line every
5 min, not a screenful. ``ROLLSTREAM_TAKE_WAIT_NOTICES=FIRST,LONGEST`` (seconds) changes both, for tests.

The cluster read is started a few seconds before each line is due, and before a ``--timeout`` runs out (5 s
before, or half way through a shorter one; it then waits for nothing), so a line holds the take back at most
`TimeoutDiagnoser`'s bound (5 s) when the broker is slow, and usually not at all, and a timed-out take names
its cause also on a loaded machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from rollstream.consumers import Batch, Diagnosis, RolloutConsumer, TakeTimeout
from rollstream.infra import UnreachableClusterError
from rollstream.schemas import ConfigError, RollstreamError

NOTICES_ENV = "ROLLSTREAM_TAKE_WAIT_NOTICES"
_READ_AHEAD_S = 5.0  # the cluster read's own bound: started this long before a line is due, it is done by then
_CONNECT_PAUSE_S = 2.0  # between two tries to connect, when the broker refused at once


@dataclass(frozen=True)
class WaitNotices:
    """When a waiting take prints: after `first_s`, then with the gap doubling from ``2 * first_s`` to `longest_s`."""

    first_s: float = 30.0
    longest_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.longest_s:
            raise ConfigError(f"wait notices first={self.first_s:g} s, longest={self.longest_s:g} s: "
                              "need 0 < first <= longest")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WaitNotices:
        """The defaults, or ``ROLLSTREAM_TAKE_WAIT_NOTICES=FIRST,LONGEST`` (seconds). Raises ConfigError."""
        text = env.get(NOTICES_ENV, "").strip()
        if not text:
            return cls()
        try:
            first, longest = (float(part) for part in text.split(","))
        except ValueError:
            raise ConfigError(f"{NOTICES_ENV}={text!r}: give FIRST,LONGEST in seconds, e.g. 30,300") from None
        return cls(first, longest)

    def times(self) -> Iterator[float]:
        """Seconds into the wait at which a line is due: 30, 90, 210, 450, 750, 1050, ... by default."""
        at, gap = self.first_s, 2 * self.first_s
        while True:
            yield at
            at, gap = at + min(gap, self.longest_s), min(2 * gap, self.longest_s)


def take_saying_why(consumer: RolloutConsumer, n: int, timeout: float | None, notices: WaitNotices,
                    say: Callable[[str], None], committed: int = 0) -> Batch:
    """``consumer.take(n, timeout, commit=False)``, calling `say` with a `waiting_line` whenever a line is due.

    Blocks until n groups are there or `timeout` s (None: no limit) have passed, connecting first within that
    time (None: the consumer's timeout), plus at most about 5 s per line (the cluster read, when the broker is slow)
    and `GRACE_S`. Commits nothing; every slice puts back what it looked at.

    Raises:
        TakeTimeout: `timeout` passed, diagnosed as a timed-out `take` is.
        RollstreamError: what `RolloutConsumer.connect` raises that is not retriable, or is once `timeout` passed
            (`connect_saying_why`); what `RolloutConsumer.poll_batch` raises.
    """
    started = time.monotonic()
    connect_saying_why(consumer, timeout, say)  # the step's time covers connecting
    due = notices.times()
    notice, read = next(due), False
    while True:
        waited = time.monotonic() - started
        due_at = notice if timeout is None else min(notice, timeout)  # a line, or the timeout's diagnosis
        read_at = max(due_at - _READ_AHEAD_S, due_at / 2)  # a take done in half its time reads nothing
        if not read and waited >= read_at:
            consumer.timeout_error(n, 0.0)  # starts the cluster read in the background; waits for nothing
            read = True
        until = due_at if read else read_at
        batch = consumer.poll_batch(n, max(0.0, until - waited), commit=False)
        if batch is not None:
            return batch
        waited = time.monotonic() - started
        if timeout is not None and waited >= timeout:
            raise consumer.timeout_error(n, timeout)
        if waited >= notice:
            say(waiting_line(consumer.timeout_error(n, waited), waited, committed))
            notice, read = next(due), False


def connect_saying_why(consumer: RolloutConsumer, timeout: float | None, say: Callable[[str], None]) -> None:
    """``consumer.connect``, tried again after each retriable failure of a cluster that answers (a broker still
    loading its groups after a restart, a coordinator moving) until `timeout` s passed (None: for ever, as the take
    waits for groups), with a line to `say` for each failed try. Does nothing once connected. Blocks until
    connected; each try is bounded by the consumer's timeout, and a try that failed at once is followed by a pause
    of up to 2 s.

    Raises what `RolloutConsumer.connect` raises that is not retriable (a missing namespace, no authorization),
    `UnreachableClusterError` (no broker answered at all: a wrong address or a cluster that is down, said at once
    rather than waited for), and a retriable failure once `timeout` passed."""
    started = time.monotonic()
    while True:
        tried = time.monotonic()
        left = None if timeout is None else max(0.0, timeout - (tried - started))
        try:
            consumer.connect(left)
            return
        except RollstreamError as exc:
            if (not exc.retriable or isinstance(exc, UnreachableClusterError)
                    or (timeout is not None and time.monotonic() - started >= timeout)):
                raise
            say(f"cannot connect yet, trying again (Ctrl-C stops, losing nothing): {' '.join(str(exc).split())}")
        pause = _CONNECT_PAUSE_S - (time.monotonic() - tried)
        if timeout is not None:
            pause = min(pause, timeout - (time.monotonic() - started))
        if pause > 0:
            time.sleep(pause)


def waiting_line(exc: TakeTimeout, waited: float, committed: int) -> str:
    """One line: how long the take has waited, the groups it has of those it wants, and why (the likely cause and
    its fix), e.g. ``take waiting for 30 s: 0 of 8 groups so far (...); why: 0 producers in demo.producers: ...``."""
    head = (f"take waiting for {_duration(waited)}: {exc.gathered} of {exc.wanted} groups so far (step not taken "
            f"yet; {committed} committed before; Ctrl-C stops, losing nothing)")
    return f"{head}; why: {why_in_one_line(exc)}"


def why_in_one_line(exc: TakeTimeout) -> str:
    """The likely cause of a take's wait, with its fix, and what the take itself looked at: one line."""
    d = exc.diagnosis
    if not isinstance(d, Diagnosis):
        return d or "are producers running? check rollstream status"
    return d.why() + (f" (this take {d.seen})" if d.seen else "")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
