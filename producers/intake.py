"""Prompt intake: NS.prompts read as a consumer group by one named thread, handed to the event loop.

Contract:
- Any number of producers share the prompts (one consumer group, cooperative-sticky assignment); with a
  ``group.instance.id`` (``--producer-id``, static membership) a restarted producer gets its
  partitions back at once, and a dead one's move to the living after the session timeout.
- A prompt's offset is committed only when the event loop acknowledged its group (`Watermarks`): per
  partition the contiguous prefix of acknowledged prompts, never past an unacknowledged one.
- At most `prefetch` prompts wait in the loop's buffer; beyond that, and whenever the loop gates intake
  (backpressure) or intake is halting, the partitions are paused and the thread keeps polling, so the
  group membership stays alive however long generation takes.
- On revocation the thread commits what is contiguous and drops the partition's bookkeeping; buffered
  prompts of that partition are not started (`is_current` turns False); groups still in flight are
  published but no longer move the watermark, so the next owner regenerates them with the same group_id.
- Every librdkafka call (poll, pause, commit, close) happens on this thread, never on the loop.
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

from infra import KafkaConfig, open_consumer
from producers._watermarks import Watermarks
from schemas import DecodeError, Prompt, RollstreamError, decode, now_ms

log = logging.getLogger(__name__)
_POLL_S = 0.1
_MAX_BATCH = 500
_FULL_WAIT_S = 1.0


@dataclass(frozen=True)
class TakenPrompt:
    """A prompt handed to the loop; `prompt` is None (and `error` set) when its bytes did not decode."""

    partition: int
    offset: int
    generation: int
    prompt: Prompt | None
    error: str | None
    taken_at_ms: int


class Intake:
    """Owns the prompt consumer on thread ``rollstream-intake``. Methods are thread-safe unless noted."""

    def __init__(self, config: KafkaConfig, topic: str, group_id: str, *, watermarks: Watermarks,
                 prefetch: int, instance_id: str | None = None, session_timeout_s: float = 10.0,
                 commit_interval_s: float = 0.2, overrides: Mapping[str, Any] | None = None) -> None:
        conf: dict[str, Any] = {"fetch.wait.max.ms": 100, "queued.min.messages": 1000,
                                "session.timeout.ms": int(session_timeout_s * 1000),
                                "heartbeat.interval.ms": max(100, int(session_timeout_s * 1000) // 4),
                                **dict(overrides or {}),
                                "partition.assignment.strategy": "cooperative-sticky"}
        if instance_id:
            conf["group.instance.id"] = instance_id
        self._conf = config.consumer(group_id, conf)
        self.topic, self.group_id = topic, group_id
        self._marks = watermarks
        self._prefetch = prefetch
        self._commit_interval_s = commit_interval_s
        self._lock = threading.Lock()
        self._credits = prefetch
        self._gated = False
        self._halting = threading.Event()
        self._closing = threading.Event()
        self._paused = False
        self._room = threading.Event()
        self._full_since: float | None = None
        self._thread: threading.Thread | None = None
        self._done: asyncio.Future[None] | None = None
        self.joined = threading.Event()
        self.last_message_at = time.monotonic()

    # -- called from the event loop -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[TakenPrompt], None],
              on_fatal: Callable[[BaseException], None]) -> None:
        """Start the thread. `deliver` and `on_fatal` are called on `loop`. Not thread-safe; call once."""
        self._loop, self._deliver, self._on_fatal = loop, deliver, on_fatal
        self._done = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="rollstream-intake", daemon=True)
        self._thread.start()

    def release_credit(self) -> None:
        """A buffered prompt left the loop's buffer (started or dropped): room for one more."""
        with self._lock:
            self._credits += 1
        self._room.set()

    def set_gated(self, gated: bool) -> None:
        """Backpressure: pause (True) or resume (False) taking prompts."""
        self._gated = gated

    def halt(self) -> None:
        """Stop handing out prompts for good (shutdown); keep polling and committing until `close`."""
        self._halting.set()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Commit the final watermarks, close the consumer (leave the group unless static), join the thread.

        Blocks the caller's coroutine (not the loop) up to `timeout_s`.
        """
        self._halting.set()
        self._closing.set()
        if self._done is not None:
            await asyncio.wait_for(asyncio.shield(self._done), timeout_s)

    @property
    def paused(self) -> bool:
        """Whether the partitions are paused right now (backpressure, full buffer or halting)."""
        return self._paused

    # -- the intake thread ------------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        consumer: Consumer | None = None
        try:
            consumer = open_consumer(self._conf)
            consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke,
                               on_lost=self._on_lost)
            last_commit = 0.0
            while not self._closing.is_set():
                for msg in self._step(consumer):
                    self._handle(msg)
                if time.monotonic() - last_commit >= self._commit_interval_s:
                    self._commit(consumer, self._marks.committable())
                    last_commit = time.monotonic()
            self._commit(consumer, self._marks.committable())
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, which decides
            error = exc
        finally:
            if consumer is not None:
                self._close_consumer(consumer)
            self._finish(error)

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
        try:
            self._loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the loop is gone: nobody is left to tell

    def _step(self, consumer: Consumer) -> list[Message]:
        """One turn of the thread: fetch what the loop has room for, or wait without losing the group."""
        with self._lock:
            credits = self._credits
        if self._gated or self._halting.is_set():
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
                raise KafkaException(err)
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("prompt consumer %s: %s", self.group_id, err.str())
            return
        partition, offset = msg.partition(), msg.offset()
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
        self._loop.call_soon_threadsafe(self._deliver, taken)

    def _commit(self, consumer: Consumer, offsets: dict[int, int]) -> dict[int, int]:
        """Commit `offsets`; mark committed only the partitions the broker accepted (the others are
        retried on the next commit tick). Returns the offsets that failed."""
        if not offsets:
            return {}
        try:
            results = consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in offsets.items()],
                                      asynchronous=False)
        except KafkaException as exc:
            err = exc.args[0]
            if getattr(err, "fatal", lambda: False)():
                raise
            log.warning("commit of %s offsets %s failed (will retry): %s", self.topic, offsets, err)
            return dict(offsets)
        failed = {}
        for tp in results or ():
            if tp.error is not None:
                failed[tp.partition] = offsets.get(tp.partition, tp.offset)
                log.warning("commit of %s[%d]@%d for group %s failed (will retry): %s", self.topic, tp.partition,
                            tp.offset, self.group_id, tp.error)
        done = {p: o for p, o in offsets.items() if p not in failed}
        self._marks.mark_committed(done)
        log.debug("committed %s offsets %s for group %s", self.topic, done, self.group_id)
        return failed

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._marks.assign([tp.partition for tp in partitions])
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
        failed = self._commit(consumer, offsets)
        if failed:  # the bookkeeping is gone: the next owner regenerates these prompts (duplicates, no loss)
            log.warning("revoked %s partitions: commit of %s failed; prompts acknowledged since the last commit "
                        "of those partitions will be generated again by the next owner", self.topic, failed)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._marks.revoke([tp.partition for tp in partitions])
        log.warning("lost %s partitions %s (session expired?): their unfinished prompts will be "
                    "regenerated by their new owner", self.topic, sorted(tp.partition for tp in partitions))


def check_not_fatal(exc: BaseException) -> RollstreamError:
    """Wrap an intake thread failure in a RollstreamError naming the thread."""
    if isinstance(exc, RollstreamError):
        return exc
    return RollstreamError(f"prompt intake failed: {type(exc).__name__}: {exc}")
