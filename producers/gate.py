"""The lag gate: backpressure from the trainer's consumer-group lag on NS.rollouts.

A thread (``rollstream-lag``) reads the lag (`infra.LagReader`) every `interval_s` (a blocking call,
never on the loop). Between two readings the gate does not trust a stale number: it counts every record
this producer produces (`note_produced`) and adds those produced since the reading started, so with
instant generation the estimate still rises record by record and the gate closes in time. The gate is
open while the estimate is at most `max_lag`; a prompt is started only once `wait_open` returns, so the
lag stays within max_lag + in-flight (the fully-async fix's "no new prompts while a full pool is waiting
to be consumed", made durable). Intake reads `is_open` from its own thread to pause the prompt partitions.
"""

from __future__ import annotations

import asyncio
import logging

from infra import KafkaConfig, LagReader, WorkerThread
from producers.metrics import ProducerMetrics

log = logging.getLogger(__name__)

# Consecutive failed lag reads after which the gate replaces its reader's client (see _fresh_reader).
_FRESH_CLIENT_AFTER = 3


class LagGate(WorkerThread):
    """Open/closed state for starting new prompts.

    `is_open` and `estimate` are thread-safe reads; `start`, `note_produced` and `wait_open` belong to
    the loop that called `start`.
    """

    def __init__(self, config: KafkaConfig, trainer_group: str, topic: str, *, max_lag: int, interval_s: float,
                 metrics: ProducerMetrics) -> None:
        super().__init__()
        self._config = config
        self.trainer_group, self.topic = trainer_group, topic
        self.max_lag = max_lag
        self._interval_s = interval_s
        self._metrics = metrics
        self._produced = 0  # records this producer produced: written on the loop only
        self._measured = 0  # the last lag reading ...
        self._base = 0  # ... and `_produced` when that reading started
        self._opened = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, timeout: float = 10.0) -> None:
        """Take a first reading (off-loop), then keep reading in the gate thread.

        Raises:
            RollstreamError: the first reading failed (topic missing, broker not answering).
        """
        self._loop = asyncio.get_running_loop()
        reader = LagReader(self._config)
        base = self._produced
        lag = await asyncio.to_thread(lambda: reader.group_lag(self.trainer_group, self.topic, timeout=timeout).total)
        self._measured, self._base = lag, base
        self._metrics.lag.set(lag)
        if self.is_open():
            self._opened.set()
        else:
            self._metrics.paused.set(1)
            log.info("intake paused from the start: lag of %s on %s is %d (max %d)", self.trainer_group, self.topic,
                     lag, self.max_lag)
        self._launch(self._run, "rollstream-lag", reader)

    @property
    def estimate(self) -> int:
        """Last reading plus what this producer produced since that reading started."""
        return self._measured + max(0, self._produced - self._base)

    def is_open(self) -> bool:
        """Whether a new prompt may start now. Thread-safe."""
        return self.estimate <= self.max_lag

    async def wait_open(self) -> None:
        """Return once the gate is open (at once when it is). Loop only."""
        await self._opened.wait()

    def note_produced(self) -> None:
        """Count one record about to be produced; the gate may close at once if it is one too many. Loop only."""
        self._produced += 1
        self._evaluate()

    def _evaluate(self) -> None:
        was_open = self._opened.is_set()
        now_open = self.is_open()
        self._metrics.lag.set(self.estimate)
        if now_open == was_open:
            return
        if now_open:
            self._opened.set()
        else:
            self._opened.clear()
        self._metrics.paused.set(0 if now_open else 1)
        log.info("intake %s: lag of %s on %s is ~%d (max %d)", "resumed" if now_open else "paused",
                 self.trainer_group, self.topic, self.estimate, self.max_lag)

    def _apply(self, lag: int, base: int) -> None:
        self._measured, self._base = lag, base
        self._evaluate()

    def _run(self, reader: LagReader) -> None:
        failures = 0
        while not self._stop.wait(self._interval_s):
            base = self._produced
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
                break
            try:
                self._loop.call_soon_threadsafe(self._apply, lag, base)
            except RuntimeError:
                break  # the loop is closed
        reader.close()

    def _fresh_reader(self, stale: LagReader) -> LagReader:
        """A new reader (new client: fresh connections and coordinator lookup) in place of one that keeps
        failing, so no state a client kept from before a broker restart or failover can pin the gate."""
        stale.close()
        return LagReader(self._config)
