"""The lag gate: backpressure from the trainer's consumer-group lag on NS.rollouts.

A thread (``rollstream-lag``) reads the lag (`infra.LagReader`) every `interval_s` (a blocking call,
never on the loop). Between two readings the gate does not trust a stale number: it adds every record
this producer produced since the reading started, so with instant generation the estimate still
rises record by record and intake stops in time. The gate is open while the estimate is at most
`max_lag`; a prompt is started only while it is open, so the lag stays within max_lag + in-flight
(the fully-async fix's "no new prompts while a full pool is waiting to be consumed", made durable).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from infra import KafkaConfig, LagReader
from infra._worker import WorkerThread

log = logging.getLogger(__name__)

# Consecutive failed lag reads after which the gate replaces its reader's client (see _fresh_reader).
_FRESH_CLIENT_AFTER = 3


class LagGate(WorkerThread):
    """Open/closed state for starting new prompts. Loop-side methods must run on the loop given to `start`."""

    def __init__(self, config: KafkaConfig, trainer_group: str, topic: str, *, max_lag: int, interval_s: float,
                 produced: Callable[[], int], on_change: Callable[[bool], None] | None = None) -> None:
        super().__init__()
        self._config = config
        self.trainer_group, self.topic = trainer_group, topic
        self.max_lag = max_lag
        self._interval_s = interval_s
        self._produced = produced
        self._on_change = on_change
        self._measured = 0
        self._base = 0
        self.measured_at = 0.0
        self.opened = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, timeout_s: float = 10.0) -> None:
        """Take a first reading (off-loop), then keep reading in the gate thread.

        Raises:
            RollstreamError: the first reading failed (topic missing, broker not answering).
        """
        self._loop = asyncio.get_running_loop()
        reader = LagReader(self._config)
        base = self._produced()
        lag = await asyncio.to_thread(lambda: reader.group_lag(self.trainer_group, self.topic,
                                                               timeout=timeout_s).total)
        self._measured, self._base, self.measured_at = lag, base, time.monotonic()
        if self.is_open():
            self.opened.set()
        else:
            log.info("intake paused from the start: lag of %s on %s is %d (max %d)", self.trainer_group, self.topic,
                     lag, self.max_lag)
        self._launch(self._run, "rollstream-lag", reader)


    @property
    def estimate(self) -> int:
        """Last reading plus what this producer produced since that reading started."""
        return self._measured + max(0, self._produced() - self._base)

    def is_open(self) -> bool:
        return self.estimate <= self.max_lag

    def evaluate(self) -> None:
        """Re-check after a produce (on the loop): may close the gate before the next reading."""
        was_open = self.opened.is_set()
        now_open = self.is_open()
        if now_open:
            self.opened.set()
        else:
            self.opened.clear()
        if now_open != was_open:
            log.info("intake %s: lag of %s on %s is ~%d (max %d)", "resumed" if now_open else "paused",
                     self.trainer_group, self.topic, self.estimate, self.max_lag)
            if self._on_change is not None:
                self._on_change(now_open)

    def _apply(self, lag: int, base: int) -> None:
        self._measured, self._base = lag, base
        self.measured_at = time.monotonic()
        self.evaluate()

    def _run(self, reader: LagReader) -> None:
        failures = 0
        while not self._stop.wait(self._interval_s):
            base = self._produced()
            try:
                lag = reader.group_lag(self.trainer_group, self.topic, timeout=max(1.0, 4 * self._interval_s)).total
            except Exception as exc:  # noqa: BLE001 -- this thread must outlive any one failed read
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("cannot read lag of %s on %s (%d times; keeping the estimate): %s",
                                self.trainer_group, self.topic, failures, exc)
                if failures % _FRESH_CLIENT_AFTER == 0:
                    reader = self._fresh_reader(reader)
                continue
            if failures >= _FRESH_CLIENT_AFTER:
                log.info("lag of %s on %s readable again after %d failed reads", self.trainer_group, self.topic,
                         failures)
            failures = 0
            if self._loop is None:
                return
            try:
                self._loop.call_soon_threadsafe(self._apply, lag, base)
            except RuntimeError:
                return  # the loop is closed
        reader.close()

    def _fresh_reader(self, stale: LagReader) -> LagReader:
        """A new reader (new client: fresh connections and coordinator lookup) in place of one that keeps
        failing, so no state a client kept from before a broker restart or failover can pin the gate."""
        stale.close()
        return LagReader(self._config)
