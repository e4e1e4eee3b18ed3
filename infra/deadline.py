"""One deadline per call: what a blocking call may spend in all, handed down to everything it waits on.

A call a user makes (take a batch, commit a step, start or stop a producer, read lag) makes one `Deadline`
when it starts and passes it down; every nested wait and retry spends what is left of it and never gets a
fresh timeout or a floor that would run past it (gRPC's deadline propagation is the model). A call that runs
out returns or raises a `RollstreamError` within its deadline plus `GRACE_S`: the time a wait already
started in librdkafka may take to notice, and the bookkeeping after it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from rollstream.schemas import ConfigError

GRACE_S = 2.0  # what a bounded call may run past its deadline (the last wait's wake-up, closing up)


@dataclass(frozen=True)
class Deadline:
    """When a unit of work must be done, on the monotonic clock. Immutable; share it freely.

    `total_s` None: no deadline (`remaining` is infinite, `timeout` None).
    """

    total_s: float | None
    expires_at: float  # time.monotonic(); inf without a deadline

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """A deadline `seconds` from now (None: none). Raises ConfigError for seconds <= 0."""
        if seconds is None:
            return cls(None, math.inf)
        if not seconds > 0:
            raise ConfigError(f"a deadline must be > 0 s, got {seconds}")
        return cls(seconds, time.monotonic() + seconds)

    @classmethod
    def of(cls, timeout: float | Deadline | None) -> Deadline:
        """What a call given `timeout` may spend: a `Deadline` as it is (a nested call spends its caller's),
        else `after(timeout)`, where 0 is a deadline already passed (only what needs no wait).
        Raises ConfigError for a negative timeout."""
        if isinstance(timeout, Deadline):
            return timeout
        if timeout == 0:
            return cls(0.0, time.monotonic())
        return cls.after(timeout)

    def remaining(self) -> float:
        """Seconds left (0 once expired; inf without a deadline)."""
        return max(0.0, self.expires_at - time.monotonic())

    @property
    def expired(self) -> bool:
        return self.remaining() <= 0.0

    def timeout(self, cap_s: float | None = None) -> float | None:
        """What one wait under this deadline may take: ``min(cap_s, remaining)``; None when both are unbounded
        (what `asyncio.timeout` and httpx take for "no limit")."""
        left = None if self.total_s is None else self.remaining()
        if cap_s is None:
            return left
        return cap_s if left is None else min(cap_s, left)

    def seconds(self, cap_s: float) -> float:
        """What one wait may take, as a number (librdkafka's timeouts): ``min(cap_s, remaining)``, >= 0."""
        return min(cap_s, self.remaining())

    def within(self, cap_s: float | None) -> Deadline:
        """A deadline for a nested step: `cap_s` from now, but never later than this one (None: this one)."""
        if cap_s is None:
            return self
        return Deadline(cap_s if self.total_s is None else min(cap_s, self.total_s),
                        min(self.expires_at, time.monotonic() + cap_s))
