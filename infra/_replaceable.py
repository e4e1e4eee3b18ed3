"""One policy for a Kafka client that stopped working for good, and one way to close a client without waiting on it.

After a broker stall a librdkafka client can lose its group coordinator for good (confluentinc/librdkafka#5511):
fetches may go on while every committed-offsets lookup and commit times out, or a group member never learns
where to fetch from again. Nothing inside the client recovers; a new client does. Three owners meet it and
share this policy: the prompt intake (`rollstream.producers.intake`), the trainer's client
(`rollstream.consumers._client`) and the lag gate's reader (`rollstream.producers.gate`).

- When (one trigger): the owner reports each failed operation of the kind that reveals the bug (`failed`)
  and each success (`succeeded`); every ``after_failures``-th failure in a row replaces the client. What
  counts as a failure is the owner's: a failed commit attempt (the trainer, 2 in a row), a failed lag read
  (the gate, 3), a stall probe that found prompts waiting while none arrived for a while (the intake, 1: the
  probe itself only runs after a long quiet spell).
- How: the new client is opened and handed to the owner first (``swap`` installs it and gives the old one
  back), so the owner goes on at once; then the old one is closed in the background (`close_quietly`,
  waiting 0 s): a client without a coordinator can block its close for long, and nothing of it is needed.
  The close is then the only call on the old client: every owner's call returns within its own deadline, kept
  with librdkafka's timeouts and asynchronous APIs (`rollstream.infra.commits`), never by leaving a call running
  in a thread, so no call of the owner is inside the client while it closes.
- Count: `replacements`, and ``on_replace(cause)``, where the owner counts its metric on its own registry
  (no global one) and logs what the replacement means for it.

`ClientReplacement` belongs to one owner thread (not thread-safe); `close_quietly` may be called from any thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, TypeVar

from confluent_kafka import KafkaException
from rollstream.infra.threads import call_within
from rollstream.schemas import ConfigError

log = logging.getLogger(__name__)

C = TypeVar("C")


def close_quietly(close: Callable[[], object], what: str, *, wait_s: float = 0.0) -> bool:
    """Run ``close()`` in a daemon thread (``rollstream-close-<what>``) and wait for it at most ``wait_s``
    seconds (0: not at all). Returns whether it finished in time; a close that did not is left to run (or
    hang) in its thread, and the process may exit without it. An error of the close is logged, never raised.
    """
    def run() -> None:
        try:
            close()
        except (KafkaException, RuntimeError) as exc:
            log.debug("closing %s: %s", what, exc)

    finished, _ = call_within(run, wait_s, f"rollstream-close-{what}")
    return finished


class ClientReplacement(Generic[C]):
    """Replaces the client of one owner after ``after_failures`` failures in a row (see the module docstring).

    ``open_client()`` makes a new client; ``swap(new)`` installs it in the owner and returns the one it
    replaces (None when there was none); ``close_client(old)`` closes a replaced one (in the background).
    """

    def __init__(self, role: str, *, open_client: Callable[[], C], swap: Callable[[C], C | None],
                 close_client: Callable[[C], object], after_failures: int,
                 on_replace: Callable[[object], None] | None = None) -> None:
        if isinstance(after_failures, bool) or not isinstance(after_failures, int) or after_failures < 1:
            raise ConfigError(f"after_failures={after_failures!r}: give the number of failures in a row (>= 1) "
                              "after which the client is replaced")
        self.role = role
        self.after_failures = after_failures
        self._open, self._swap, self._close = open_client, swap, close_client
        self._on_replace = on_replace
        self.failures = 0  # in a row, since the last success (not reset by a replacement)
        self.replacements = 0

    def failed(self, cause: object) -> C | None:
        """Note one failure; at every ``after_failures``-th in a row, replace the client and return the new one.

        Blocks as long as opening a client does (no network call: librdkafka connects in the background).
        Raises what ``open_client`` raises (the old client is then kept).
        """
        self.failures += 1
        if self.failures % self.after_failures:
            return None
        return self.replace(cause)

    def succeeded(self) -> int:
        """End a streak of failures; returns how long it was (0 when there was none)."""
        streak, self.failures = self.failures, 0
        return streak

    def replace(self, cause: object) -> C:
        """Open a new client, install it (``swap``), close the old one in the background, count it."""
        new = self._open()
        old = self._swap(new)
        if old is not None:
            close_quietly(lambda: self._close(old), f"stale-{self.role}")
        self.replacements += 1
        if self._on_replace is not None:
            self._on_replace(cause)
        return new
