"""Prompt intake: NS.prompts read as a consumer group by one named thread, handed to the event loop.

Contract:
- Any number of producers share the prompts (one consumer group, cooperative-sticky assignment); with a
  ``group.instance.id`` (``--producer-id``, static membership) a restarted producer gets its
  partitions back at once, and a dead one's move to the living after the session timeout.
- A prompt's offset is committed only when the event loop acknowledged its group (`Watermarks`): per
  partition the contiguous prefix of acknowledged prompts, never past an unacknowledged one.
- The loop takes prompts with ``async for taken in intake`` and acknowledges each with `ack(taken)` once
  its group is durably written. At most `prefetch` prompts wait in the hand-over queue; the loop starts
  one only while the lag gate is open (backpressure), so while it is closed the queue fills and intake
  waits with the fetch state kept, then (after `_FULL_WAIT_S`) pauses the partitions; when intake is
  halting they are paused at once. The thread keeps polling, so the group membership stays alive
  however long generation or backpressure lasts. Not pausing at every gate close matters: a
  pause/resume cycle costs a refetch, and the gate opens and closes at every trainer step.
- On revocation the thread commits what is contiguous and drops the partition's bookkeeping; queued
  prompts of that partition are skipped (`is_current` turns False); groups still in flight are
  published but no longer move the watermark, so the next owner regenerates them with the same group_id.
- The watermarks and the credits are this object's own; every librdkafka call (poll, pause, commit,
  close) happens on its thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from infra import CommitFailed, KafkaConfig, WorkerThread, commit_offsets, kafka_error, open_consumer, position_of
from producers._watermarks import Watermarks
from producers.gate import LagGate
from producers.metrics import ProducerMetrics
from schemas import DecodeError, Prompt, decode, now_ms

log = logging.getLogger(__name__)
_POLL_S = 0.1
_MAX_BATCH = 500
_FULL_WAIT_S = 1.0
_MIN_STALL_S = 20.0  # at least this long without a prompt, while wanting some, before suspecting the client
_STALL_PROBE_S = 5.0


@dataclass(frozen=True)
class TakenPrompt:
    """A prompt handed to the loop; `prompt` is None (and `error` set) when its bytes did not decode."""

    partition: int
    offset: int
    generation: int
    prompt: Prompt | None
    error: str | None
    taken_at_ms: int


class Intake(WorkerThread):
    """Owns the prompt consumer on thread ``rollstream-intake``; an async iterator of `TakenPrompt`.

    `start`, iteration, `ack`, `halt` and `close` belong to the loop given to `start`; `settled`,
    `buffered`, `joined` and `last_message_at` may be read from any thread.
    """

    def __init__(self, config: KafkaConfig, topic: str, group_id: str, *, gate: LagGate, metrics: ProducerMetrics,
                 prefetch: int, instance_id: str | None = None, session_timeout_s: float = 10.0,
                 commit_interval_s: float = 0.2,
                 overrides: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        conf: dict[str, Any] = {"fetch.wait.max.ms": 100, "queued.min.messages": 1000,
                                "session.timeout.ms": int(session_timeout_s * 1000),
                                "heartbeat.interval.ms": max(100, int(session_timeout_s * 1000) // 4),
                                **dict(overrides or {}),
                                "partition.assignment.strategy": "cooperative-sticky"}
        if instance_id:
            conf["group.instance.id"] = instance_id
        self._conf = config.consumer(group_id, conf)
        self.topic, self.group_id = topic, group_id
        self._gate = gate
        self._metrics = metrics
        self._marks = Watermarks()
        self._commit_interval_s = commit_interval_s
        self._lock = threading.Lock()
        self._credits = prefetch  # prompts the thread may still hand over before the loop takes some
        # Bounded: the credits keep at most `prefetch` prompts in it; the extra slot is for the halt marker.
        self._queue: asyncio.Queue[TakenPrompt | None] = asyncio.Queue(maxsize=prefetch + 1)
        self._halting = threading.Event()
        self._paused = False  # the intake thread's own view of the partitions' pause state
        self._room = threading.Event()
        self._full_since: float | None = None
        self._done: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_fatal: Callable[[BaseException], None] = lambda exc: None
        self.joined = threading.Event()
        self.last_message_at = time.monotonic()
        self.client_replacements = 0  # clients replaced because they were stuck (see `_stuck`)
        self._stall_s = max(_MIN_STALL_S, 2 * session_timeout_s)
        self._next_stall_check = 0.0
        self._assigned_at = time.monotonic()

    # -- called from the event loop -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, on_fatal: Callable[[BaseException], None]) -> None:
        """Start the thread; `on_fatal` is called on `loop` if it dies. Call once."""
        self._loop, self._on_fatal = loop, on_fatal
        self._done = loop.create_future()
        self._launch(self._run, "rollstream-intake")

    def __aiter__(self) -> Intake:
        return self

    async def __anext__(self) -> TakenPrompt:
        """The next prompt still owned by this producer; ends once `halt` was called."""
        while True:
            taken = await self._queue.get()
            if taken is None:
                self._queue.put_nowait(None)  # every later call ends too
                raise StopAsyncIteration
            with self._lock:
                self._credits += 1
            self._room.set()
            if self.is_current(taken):
                return taken
            log.debug("%s[%d]@%d: partition revoked while queued; the new owner takes it", self.topic,
                      taken.partition, taken.offset)

    def _hand_over(self, taken: TakenPrompt) -> None:
        self._queue.put_nowait(taken)  # never full: the thread holds a credit for it
        self._metrics.count_prompt()

    def is_current(self, taken: TakenPrompt) -> bool:
        """Whether `taken`'s partition is still owned under the assignment it was taken in."""
        return self._marks.is_current(taken.partition, taken.generation)

    def ack(self, taken: TakenPrompt) -> bool:
        """`taken`'s group is durably written: its offset may be committed. False when no longer owned."""
        return self._marks.ack(taken.partition, taken.offset, taken.generation)

    @property
    def buffered(self) -> int:
        """Prompts handed over and not taken by the loop yet."""
        return self._queue.qsize()

    def owned(self) -> list[int]:
        """The prompt partitions assigned to this producer now. Thread-safe."""
        return self._marks.owned()

    def settled(self) -> bool:
        """Nothing taken is unacknowledged and every watermark is committed."""
        return self._marks.settled()

    def halt(self) -> None:
        """Stop handing out prompts for good (shutdown); keep polling and committing until `close`.

        Queued prompts are dropped (left uncommitted for the next owner). Idempotent."""
        if self._halting.is_set():
            return
        self._halting.set()
        dropped = 0
        while not self._queue.empty():
            dropped += self._queue.get_nowait() is not None
        self._queue.put_nowait(None)
        if dropped:
            log.info("stopping: %d queued prompts not started (left uncommitted for the next owner)", dropped)

    async def close(self, timeout: float = 30.0) -> None:
        """Commit the final watermarks, close the consumer (leave the group unless static), join the thread.

        Blocks the caller's coroutine (not the loop) up to `timeout`.
        Raises:
            TimeoutError: the thread did not finish in time (its last commit may be missing).
        """
        self.halt()
        self.stop()
        if self._done is not None:
            await asyncio.wait_for(asyncio.shield(self._done), timeout)

    # -- the intake thread ------------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            while not self._stop.is_set():
                consumer = open_consumer(self._conf)
                if not self._serve(consumer):
                    self._close_consumer(consumer)
                    break
                # Stuck: leave the old client to close in the background (a group member without a
                # coordinator may block its close) and join the group again with a fresh one.
                threading.Thread(target=self._close_consumer, args=(consumer,), name="rollstream-close-stale",
                                 daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, which decides
            error = exc
        finally:
            self._finish(error)

    def _serve(self, consumer: Consumer) -> bool:
        """Take, hand over and commit with `consumer` until `close` (False) or until it is stuck (True)."""
        consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_lost)
        last_commit = 0.0
        while not self._stop.is_set():
            for msg in self._step(consumer):
                self._handle(msg)
            if time.monotonic() - last_commit >= self._commit_interval_s:
                commit_acknowledged(consumer, self.topic, self.group_id, self._marks)
                last_commit = time.monotonic()
            if self._stuck(consumer):
                return True
        commit_acknowledged(consumer, self.topic, self.group_id, self._marks)
        return False

    def _stuck(self, consumer: Consumer) -> bool:
        """Whether this client stopped serving its partitions while prompts wait there.

        After a broker stall a client can lose its group coordinator for good (confluentinc/librdkafka#5511):
        it then never learns where to fetch from, so no prompt arrives while the partitions hold some.
        Checked only after `_stall_s` without a prompt while intake wanted some (not paused, room in the
        queue): the committed offsets must be readable, and each partition must hold nothing beyond them and
        beyond what this client took. When that fails, the partitions are dropped as lost (their
        acknowledgements are ignored from now on, their unfinished prompts regenerated by the next owner:
        duplicates at worst, never a loss)."""
        now = time.monotonic()
        quiet = now - max(self.last_message_at, self._assigned_at)
        if self._paused or not self.joined.is_set() or quiet < self._stall_s or now < self._next_stall_check:
            return False
        self._next_stall_check = now + self._stall_s / 2
        with self._lock:
            if self._credits <= 0:
                return False
        assignment = consumer.assignment()
        if not assignment:
            return False
        try:
            committed = consumer.committed(assignment, timeout=_STALL_PROBE_S)
            # Prompts wait past what is committed and past what this client took (in flight is not waiting).
            waiting = [tp.partition for tp in committed
                       if consumer.get_watermark_offsets(tp, timeout=_STALL_PROBE_S, cached=False)[1]
                       > max(tp.offset, self._marks.taken_up_to(tp.partition) or 0, 0)]
        except KafkaException as exc:
            waiting, reason = [tp.partition for tp in assignment], f"committed offsets unreadable: {exc}"
        else:
            reason = f"partitions {waiting} hold prompts"
        if not waiting:
            return False
        self._marks.revoke([tp.partition for tp in assignment])
        self.client_replacements += 1
        log.warning("prompt consumer of group %s received nothing for %.0f s while %s: replacing its client "
                    "(its unfinished prompts are regenerated by their next owner)", self.group_id, quiet, reason)
        return True

    def _close_consumer(self, consumer: Consumer) -> None:
        try:
            consumer.close()
        except (KafkaException, RuntimeError) as exc:
            log.warning("closing the prompt consumer of group %s: %s", self.group_id, exc)

    def _finish(self, error: BaseException | None) -> None:
        def done() -> None:
            if self._done is not None and not self._done.done():
                self._done.set_result(None)
            if error is not None:
                self._on_fatal(error)
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the loop is gone: nobody is left to tell

    def _step(self, consumer: Consumer) -> list[Message]:
        """One turn of the thread: fetch what the loop has room for, or wait without losing the group."""
        with self._lock:
            credits = self._credits
        if self._halting.is_set():
            self._set_paused(consumer, True)
        elif credits > 0:
            self._full_since = None
            self._set_paused(consumer, False)
            messages = consumer.consume(num_messages=min(credits, _MAX_BATCH), timeout=0)
            if messages:
                return messages
            one = consumer.poll(_POLL_S)  # returns as soon as one prompt arrives
            return [one] if one is not None else []
        else:
            # The buffer is full: generation is the bottleneck. Wait for room without touching the
            # fetch state (a pause/resume cycle costs a refetch, up to ~1 s); past _FULL_WAIT_S pause
            # and poll, so rebalances are served however long generation takes.
            now = time.monotonic()
            self._full_since = self._full_since or now
            if not self._paused and now - self._full_since < _FULL_WAIT_S:
                self._room.wait(_POLL_S)
                self._room.clear()
                return []
            self._set_paused(consumer, True)
        one = consumer.poll(_POLL_S)  # paused: serves rebalances and errors; a message is still taken
        return [one] if one is not None else []

    def _set_paused(self, consumer: Consumer, paused: bool) -> None:
        if paused == self._paused:
            return
        assignment = consumer.assignment()
        if assignment:
            (consumer.pause if paused else consumer.resume)(assignment)
        self._paused = paused

    def _handle(self, msg: Message) -> None:
        err = msg.error()
        if err is not None:
            if err.fatal():
                raise kafka_error(f"prompt consumer of group {self.group_id}", err, topic=self.topic)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("prompt consumer %s: %s", self.group_id, err.str())
            return
        partition, offset = position_of(msg)
        generation = self._marks.take(partition, offset)
        if generation is None:
            log.debug("message %s[%d]@%d from a partition no longer owned; skipped", self.topic, partition, offset)
            return
        prompt, error = None, None
        try:
            prompt = decode(msg.value() or b"", Prompt)
        except DecodeError as exc:
            error = str(exc.located(self.topic, partition, offset))
            log.error("undecodable prompt: %s", error)
        with self._lock:
            self._credits -= 1
        self.last_message_at = time.monotonic()
        taken = TakenPrompt(partition, offset, generation, prompt, error, now_ms())
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._hand_over, taken)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._marks.assign([tp.partition for tp in partitions])
        self._assigned_at = time.monotonic()
        consumer.incremental_assign(partitions)
        if partitions:
            # Explicitly, both ways: librdkafka keeps a partition's pause flag across a loss and a
            # reassignment, so a partition lost while paused would come back paused with nothing left
            # to resume it (seen when a broker node died: intake stalled for good).
            (consumer.pause if self._paused else consumer.resume)(partitions)
        self.joined.set()
        if partitions:
            log.info("assigned %s partitions %s", self.topic, sorted(tp.partition for tp in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        offsets = self._marks.revoke([tp.partition for tp in partitions])
        log.info("revoked %s partitions %s%s", self.topic, sorted(tp.partition for tp in partitions),
                 f"; committing {offsets}" if offsets else "")
        failed = _commit(consumer, self.topic, self.group_id, offsets)
        if failed:  # the bookkeeping is gone: the next owner regenerates these prompts (duplicates, no loss)
            log.warning("revoked %s partitions: commit of %s failed; prompts acknowledged since the last commit "
                        "of those partitions will be generated again by the next owner", self.topic, failed)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._marks.revoke([tp.partition for tp in partitions])
        log.warning("lost %s partitions %s (session expired?): their unfinished prompts will be "
                    "regenerated by their new owner", self.topic, sorted(tp.partition for tp in partitions))


def commit_acknowledged(consumer: Consumer, topic: str, group_id: str, marks: Watermarks) -> dict[int, int]:
    """Commit every watermark of `marks` that moved; mark committed only the partitions the broker
    accepted (the others are retried on the next commit tick). Blocks; intake thread only.

    Returns the offsets that failed. Raises CommitFailed when librdkafka calls the failure fatal.
    """
    offsets = marks.committable()
    failed = _commit(consumer, topic, group_id, offsets)
    marks.mark_committed({p: o for p, o in offsets.items() if p not in failed})
    return failed


def _commit(consumer: Consumer, topic: str, group_id: str, offsets: dict[int, int]) -> dict[int, int]:
    """Commit `offsets`; return those of the partitions that failed (retried on the next tick)."""
    try:
        commit_offsets(consumer, topic, offsets)
    except CommitFailed as exc:
        if exc.fatal:
            raise
        failed = {p: offsets[p] for p in exc.failed if p in offsets}
        for p, offset in failed.items():
            log.warning("commit of %s[%d]@%d for group %s failed (will retry): %s", topic, p, offset, group_id,
                        exc.failed[p])
        return failed
    log.debug("committed %s offsets %s for group %s", topic, offsets, group_id)
    return {}
