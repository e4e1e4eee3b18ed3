"""The lag gate: backpressure from the trainer's consumer-group lag on NS.rollouts.

Two sources of the lag, each with the moment it was true:

- pushed: the trainer's `RolloutConsumer` publishes its position (`rollstream.schemas.TrainerPosition`: committed
  and end offsets, and when it saw the ends) on NS.control after every commit; the producer's control
  watcher hands it to `follow`, and the gate re-evaluates on the loop within milliseconds of the commit.
  One record per trainer step, whatever the number of producers.
- read: a thread (``rollstream-lag``) reads the lag itself (`rollstream.infra.LagReader`, a blocking call, never on
  the loop) every `interval_s`; once a pushed position of its trainer group came, only when none came
  for `fallback_s` (a trainer in a long step, or down; a lost position costs seconds at most), and then
  every `fallback_s`. A trainer that never publishes (not rollstream's consumer) is polled as before.

Between two updates the gate does not trust a stale number: it counts every record this producer
produces (`note_produced`) and adds those not in the update: for a read, those produced since it
started; for a pushed position, those not acknowledged by the broker (`note_settled`) by a little before
the trainer saw its end offsets (`_PUSHED_MARGIN_MS`: a fetch round trip, and clocks of one host or
rack), which the trainer's end offsets cannot hold. So with instant generation the estimate still rises
record by record and the gate closes in time. An update older than the one applied is ignored. The gate is
open while the estimate is at most `max_lag`; a prompt is started only once `wait_open` returns, so the
lag stays within max_lag + in-flight (the fully-async fix's "no new prompts while a full pool is waiting
to be consumed", made durable). Intake reads `is_open` from its own thread to pause the prompt partitions.

`max_lag` is one number for the whole fleet: besides the estimate, the gate holds a prompt back while this
producer's own outstanding groups exceed its share of max_lag (`rollstream.producers._share.FleetShare`: the
share follows the NS.prompts partitions it owns, which intake reports with `set_owned`, and the fraction of
the trainer's commits that were its records). Both the pushed positions and the gate's own reads carry the
trainer group's committed offsets per partition, which is all the share needs; so the polling fallback
keeps it too (only the consumption part follows pushed positions alone).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Mapping

from rollstream.infra import GroupLag, KafkaConfig, LagReader
from rollstream.infra._replaceable import ClientReplacement
from rollstream.infra.deadline import Deadline
from rollstream.infra.threads import WorkerThread, in_thread
from rollstream.producers._share import FleetShare
from rollstream.producers.metrics import ProducerMetrics
from rollstream.schemas import TrainerPosition, now_ms

log = logging.getLogger(__name__)

# Failed lag reads in a row after which (and after each further as many) the gate replaces its reader: a new
# client (fresh connections and coordinator lookup), so no state a client kept from before a broker restart
# or failover can pin the gate (rollstream.infra._replaceable.ClientReplacement).
_FRESH_CLIENT_AFTER = 3
_PUSHED_MARGIN_MS = 5  # a pushed position counts this producer's records acknowledged from this long before it
_STALL_S = 5.0  # a polling gate's stall time (see `FleetShare.admits_in_stall`)
_HISTORY_MS = 60_000  # how far back the produced counts are kept (older positions count everything since)


class LagGate(WorkerThread):
    """Open/closed state for starting new prompts.

    `is_open` and `estimate` are thread-safe reads, `follow` and `set_owned` thread-safe hand-overs; `start`,
    `note_produced`, `note_settled` and `wait_open` belong to the loop that called `start`.

    Args:
        prompts_topic: NS.prompts, whose partition count the share is a fraction of (None: this producer's
            share is the whole max_lag, as for a producer alone).
    """

    def __init__(self, config: KafkaConfig, trainer_group: str, topic: str, *, max_lag: int, interval_s: float,
                 metrics: ProducerMetrics, fallback_s: float | None = None, prompts_topic: str | None = None) -> None:
        super().__init__()
        self._config = config
        self.trainer_group, self.topic = trainer_group, topic
        self.max_lag = max_lag
        self.prompts_topic = prompts_topic
        self.share = FleetShare(max_lag)  # loop-only, but for its plain reads
        self._position_at_ms = 0  # the newest pushed position the share applied
        # The share's stall rule applies after this long without a commit: by then a pushed-mode gate reads the lag
        # itself (`fallback_s`), a polling one has read it several times.
        self._stall_s = fallback_s if fallback_s is not None else _STALL_S
        self._interval_s = interval_s
        self._fallback_s = fallback_s  # None: never slow down (polling only)
        self._pushed_at: float | None = None  # time.monotonic() of the last pushed position (written on the loop)
        self._metrics = metrics
        self._produced = 0  # records this producer produced: written on the loop only
        self._measured = 0  # the last lag update ...
        self._base = 0  # ... and `_produced` when it was true
        self._as_of_ms = 0  # ... and when that was (wall clock)
        self._settled = 0  # records acknowledged or refused by the broker: written on the loop only
        self._history: deque[tuple[int, int]] = deque()  # (wall ms, _settled) at each note_settled
        self._opened = asyncio.Event()
        # Whether the trainer group was ever seen committing (plain flags, any thread: at worst a second warning).
        self._trainer_seen = False
        self._mismatch_warned = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: LagReader | None = None  # the gate thread's reader (that thread only)
        self._readers = ClientReplacement[LagReader](
            "lag", open_client=lambda: LagReader(self._config), swap=self._swap_reader, close_client=LagReader.close,
            after_failures=_FRESH_CLIENT_AFTER, on_replace=lambda _: metrics.client_replacements.labels("lag").inc())

    async def start(self, timeout: float | Deadline = 10.0) -> None:
        """Take a first reading (off-loop, at most `timeout`: seconds, or the caller's `Deadline` both of its
        reads spend), then keep reading in the gate thread.

        Raises:
            RollstreamError: the first reading failed (topic missing, broker not answering).
        """
        self._loop = asyncio.get_running_loop()
        reader = LagReader(self._config)
        base, as_of = self._produced, now_ms()
        deadline = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
        first, partitions = await in_thread(lambda: self._first_reading(reader, deadline),
                                            name="rollstream-lag-first")  # a thread of its own: never behind user code
        lag = first.total
        self._measured, self._base, self._as_of_ms = lag, base, as_of
        self.share.set_partitions(partitions)
        self.share.note_committed(_committed(first), pushed=False)
        self._metrics.lag.set_function(lambda: self.estimate)  # read when scraped, not set per record
        self._metrics.share.set_function(lambda: self.share.share)
        self._metrics.outstanding.set_function(lambda: self.share.outstanding)
        if self.is_open():
            self._opened.set()
        else:
            self._metrics.paused.set(1)
            log.info("intake paused from the start: lag of %s on %s is %d (max %d)", self.trainer_group, self.topic,
                     lag, self.max_lag)
        self._launch(self._run, "rollstream-lag", reader)

    def _first_reading(self, reader: LagReader, deadline: Deadline) -> tuple[GroupLag, int]:
        lag = reader.group_lag(self.trainer_group, self.topic, timeout=deadline.seconds(math.inf))
        self._trainer_seen = any(p.committed is not None for p in lag.partitions)
        if not self.prompts_topic:
            return lag, 0
        return lag, len(reader.partitions(self.prompts_topic, timeout=deadline.seconds(math.inf)))

    @property
    def estimate(self) -> int:
        """Last reading plus what this producer produced since that reading started."""
        return self._measured + max(0, self._produced - self._base)

    def is_open(self) -> bool:
        """Whether a new prompt may start now: the fleet's estimated lag is at most max_lag and this producer's
        own outstanding groups are at most its share of it (while the trainer commits nothing for `stall_s`:
        what it produced since the last reading, at most its share of the headroom). Thread-safe."""
        if self.estimate > self.max_lag:
            return False
        if time.monotonic() - self.share.advanced_at < self._stall_s:
            return self.share.admits
        return self.share.admits_in_stall(max(0, self._produced - self._base), self._measured)

    async def wait_open(self) -> None:
        """Return once the gate is open (at once when it is). Loop only."""
        await self._opened.wait()

    def note_produced(self) -> None:
        """Count one record about to be produced; the gate may close at once if it is one too many. Loop only."""
        self._produced += 1
        self.share.note_produced()
        self._evaluate()

    def note_settled(self, partition: int | None = None, offset: int | None = None) -> None:
        """Count one produced record the broker acknowledged at `partition`, `offset` (None: refused, or the
        outcome is unknown). Loop only."""
        if partition is not None and offset is not None:
            self.share.note_delivered(partition, offset)
        else:
            self.share.note_refused()
        self._settled += 1
        now = now_ms()
        self._history.append((now, self._settled))
        while self._history and self._history[0][0] < now - _HISTORY_MS:
            self._history.popleft()
        self._evaluate()

    def follow(self, position: TrainerPosition) -> None:
        """A trainer position from NS.control (any thread): applied on the loop if it is this gate's trainer
        group and topic and newer than what the gate knows. Never blocks."""
        if position.topic == self.topic and position.consumer_group != self.trainer_group:
            self._other_group(position.consumer_group)
            return
        if position.topic != self.topic or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._apply_position, position)
        except RuntimeError:
            pass  # the loop is closed: the producer is stopping

    def _other_group(self, group: str) -> None:
        """Another trainer group commits on the topic: warn once when this gate's own never did (a mismatch pauses
        the producers for good once their max lag is reached)."""
        if self._trainer_seen or self._mismatch_warned:
            return
        self._mismatch_warned = True
        log.warning("trainer group mismatch: this producer gates on trainer group %s, which never committed on %s, "
                    "while trainer group %s commits there: start the producers with --trainer-group %s (or "
                    "ROLLSTREAM_TRAINER_GROUP), or the trainer with --group %s", self.trainer_group, self.topic, group,
                    group, self.trainer_group)

    def set_owned(self, partitions: int) -> None:
        """How many NS.prompts partitions this producer owns now (intake's rebalance callbacks, any thread):
        its share follows. Never blocks."""
        if self._loop is None:
            self.share.set_owned(partitions)  # before start: nothing else touches it yet
            return
        try:
            self._loop.call_soon_threadsafe(self._set_owned, partitions)
        except RuntimeError:
            pass  # the loop is closed: the producer is stopping

    def _set_owned(self, partitions: int) -> None:
        self.share.set_owned(partitions)
        self._evaluate()

    def _apply_position(self, position: TrainerPosition) -> None:
        self._pushed_at = time.monotonic()
        self._trainer_seen = True
        if position.observed_at_ms > self._position_at_ms:
            # Every position, also one older than a read the estimate applied since: all producers must apply the
            # same positions for their consumption parts to add up.
            self._position_at_ms = position.observed_at_ms
            self.share.note_committed(position.committed, pushed=True)
        self._apply(position.lag, self._settled_before(position.observed_at_ms - _PUSHED_MARGIN_MS),
                    position.observed_at_ms, "pushed", position.committed)

    def _settled_before(self, when_ms: int) -> int:
        """How many of this producer's records the broker had settled at wall time `when_ms`."""
        i = bisect.bisect_right(self._history, (when_ms, self._settled + 1))
        if i > 0:
            return self._history[i - 1][1]
        return self._history[0][1] - 1 if self._history else self._settled

    def _evaluate(self) -> None:
        was_open = self._opened.is_set()
        now_open = self.is_open()
        if now_open == was_open:
            return
        if now_open:
            self._opened.set()
        else:
            self._opened.clear()
        self._metrics.paused.set(0 if now_open else 1)
        share = self.share
        if now_open or self.estimate > self.max_lag:
            log.info("intake %s: lag of %s on %s is ~%d (max %d); own outstanding %d, share %.1f",
                     "resumed" if now_open else "paused", self.trainer_group, self.topic, self.estimate, self.max_lag,
                     share.outstanding, share.share)
        else:
            log.info("intake paused: waiting for its share: %d own groups not yet committed by %s on %s, share %.1f "
                     "of max_lag %d (%d of %d prompt partitions)", share.outstanding, self.trainer_group, self.topic,
                     share.share, self.max_lag, share.owned, share.partitions)

    def _apply(self, lag: int, base: int, as_of_ms: int, source: str, committed: Mapping[int, int]) -> None:
        if as_of_ms < self._as_of_ms:
            return  # older than the update applied already
        self._measured, self._base, self._as_of_ms = lag, base, as_of_ms
        self.share.note_committed(committed, pushed=False)  # positions: in `_apply_position`
        self._metrics.lag_updates.labels(source).inc()
        self._evaluate()

    def _run(self, reader: LagReader) -> None:
        self._reader = reader
        while not self._stop.wait(self._next_read_in()):
            if self._pushed_recently():
                continue
            base, as_of = self._produced, now_ms()
            try:
                read = reader.group_lag(self.trainer_group, self.topic, timeout=max(1.0, 4 * self._interval_s))
            except Exception as exc:  # noqa: BLE001 -- this thread must outlive any one failed read
                failures = self._readers.failures + 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("cannot read lag of %s on %s (%d times; keeping the estimate): %s",
                                self.trainer_group, self.topic, failures, exc)
                reader = self._readers.failed(exc) or reader  # every _FRESH_CLIENT_AFTER-th in a row: a new one
                continue
            failures = self._readers.succeeded()
            self._trainer_seen = self._trainer_seen or any(p.committed is not None for p in read.partitions)
            if failures >= _FRESH_CLIENT_AFTER:
                log.info("lag of %s on %s readable again after %d failed reads", self.trainer_group, self.topic,
                         failures)
            if self._loop is None:
                break
            try:
                self._loop.call_soon_threadsafe(self._apply, read.total, base, as_of, "read", _committed(read))
            except RuntimeError:
                break  # the loop is closed
        reader.close()

    def _next_read_in(self) -> float:
        return self._fallback_s if self._fallback_s is not None and self._pushed_at is not None else self._interval_s

    def _pushed_recently(self) -> bool:
        """A pushed position came within `fallback_s`: no read needed (thread-safe read of one float)."""
        pushed_at = self._pushed_at
        return (self._fallback_s is not None and pushed_at is not None
                and time.monotonic() - pushed_at < self._fallback_s)

    def _swap_reader(self, fresh: LagReader) -> LagReader | None:
        """Make `fresh` the gate thread's reader; return the one it replaces (closed in the background)."""
        stale, self._reader = self._reader, fresh
        return stale


def _committed(lag: GroupLag) -> dict[int, int]:
    """The group's committed offset per partition, as the lag counts it (nothing committed: the start)."""
    return {p.partition: max(p.start, p.committed if p.committed is not None else p.start) for p in lag.partitions}
