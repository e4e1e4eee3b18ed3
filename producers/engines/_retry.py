"""One deadline per group, and the one backoff every producer-side retry uses.

A group has one `Deadline` (`rollstream.infra.deadline`), made when it starts (`rollstream.producers._pipeline`)
and handed down to the engine. Every retry under it spends that budget and never extends or multiplies it
(gRPC's deadline propagation is the model): an HTTP request waits at most ``min(its own timeout, what is
left)``, a backoff sleeps at most what is left, and once nothing is left the work ends with a retriable
`EngineError` (the trainer may requeue the prompt). `Backoff` is bounded exponential with jitter;
`RetryPolicy` says how many tries a sample gets within the deadline.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from rollstream.infra.deadline import Deadline
from rollstream.producers.engines.base import EngineError
from rollstream.schemas import ConfigError

DEFAULT_GROUP_TIMEOUT_S = 1800.0  # a group: its requests (600 s each, engines' default), retries and scoring


def out_of_time(deadline: Deadline, what: str, last: str | None = None) -> EngineError:
    """The retriable error of a group's work that ran out of its `deadline` (`last`: the failure before it)."""
    tail = f"; last: {last}" if last else ""
    return EngineError(f"{what} took longer than {deadline.total_s:g} s, the group's deadline (--group-timeout / "
                       f"generate_timeout_s){tail}", retriable=True)


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with jitter: after the k-th failure wait ``min(max_s, first_s * 2**(k-1))``
    times a random factor in [0.5, 1) (so retries of many samples do not march in step)."""

    first_s: float = 0.5
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.first_s < 0 or self.max_s < 0:
            raise ConfigError(f"invalid backoff {self}: both >= 0")

    def delay_s(self, failures: int, rng: random.Random) -> float:
        return min(self.max_s, self.first_s * 2 ** max(0, failures - 1)) * (0.5 + rng.random() / 2)

    async def sleep(self, failures: int, rng: random.Random, deadline: Deadline | None = None) -> None:
        """Sleep the delay after `failures` failures, never past `deadline`."""
        delay = self.delay_s(failures, rng)
        if deadline is not None:
            delay = min(delay, deadline.remaining())
        await asyncio.sleep(delay)


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries per sample, all within the group's `Deadline`. Backoff (`backoff`) doubles from
    `backoff_s` up to `max_backoff_s`, with jitter.

    `attempts`: tries of a request that failed (connection, timeout, 5xx); `abort_attempts`: re-issues of
    an aborted request from scratch; `max_continuations`: continuations of an aborted sample from its
    partial output (``partial_rollouts="continue"``).
    """

    attempts: int = 5
    abort_attempts: int = 20
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    max_continuations: int = 4

    def __post_init__(self) -> None:
        if (self.attempts < 1 or self.abort_attempts < 0 or self.backoff_s < 0 or self.max_backoff_s < 0
                or self.max_continuations < 0):
            raise ConfigError(f"invalid retry policy {self}: attempts >= 1, the rest >= 0")

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_s, self.max_backoff_s)

    def delay_s(self, failures: int, rng: random.Random) -> float:
        return self.backoff.delay_s(failures, rng)
