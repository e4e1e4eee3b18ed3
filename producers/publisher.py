"""Publishing records from an event loop over a confluent-kafka `Producer`, without ever blocking the loop.

- Idempotent, acks=all, lz4 (`KafkaConfig.producer`): a retry inside librdkafka never duplicates.
- ``produce`` is called on the loop: it only copies the bytes into librdkafka's queue. When that queue
  is full (``BufferError``) the record is handed to a worker thread that waits for room (woken by
  delivery reports) and produces it there; later records queue behind it, so order is kept and the
  loop keeps running (the fully-async bug was exactly a blocking put on the loop).
- A dedicated thread (``rollstream-publish-poll``) serves delivery reports; each report only queues the
  future's result, and the results of one `poll` reach the loop in one ``call_soon_threadsafe`` (one
  wake-up of the loop per batch of reports, not per record), so a callback never blocks.
- `close` flushes in a thread of its own, so a produce waiting for room (broker down) never holds it
  past its timeout.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from rollstream.infra import KafkaConfig, KafkaIOError
from rollstream.infra.clients import open_producer
from rollstream.infra.deadline import Deadline
from rollstream.infra.threads import ThreadPool, WorkerThread, in_thread
from rollstream.schemas import LifecycleError

log = logging.getLogger(__name__)
_Record = tuple[bytes, bytes | None, int]  # key, value (None: a tombstone), partition (-1: by the key)


class PublishError(KafkaIOError):
    """A record was not acknowledged by the broker.

    Attributes:
        topic: where it was going.
        code: librdkafka's error name (``MSG_SIZE_TOO_LARGE``, ``_MSG_TIMED_OUT``, ...).
    """

    code: str

    def __init__(self, message: str, *, topic: str, code: str, retriable: bool = False, fatal: bool = False) -> None:
        super().__init__(message, topic=topic, code=code, retriable=retriable, fatal=fatal)


@dataclass(frozen=True)
class Delivery:
    """Where the broker stored a record."""

    topic: str
    partition: int
    offset: int


class Publisher(WorkerThread):
    """Async-safe publishing to one topic. `start` on the loop, then `publish` from coroutines on it.

    Thread-safety: `publish` and `close` must be awaited on the loop given to `start`.
    """

    def __init__(self, config: KafkaConfig, topic: str, *, overrides: Mapping[str, Any] | None = None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 on_queue_full: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.topic = topic
        self._conf = config.producer({**dict(overrides or {}), "error_cb": self._on_error})
        self._on_fatal = on_fatal
        self._on_queue_full = on_queue_full
        self._producer: Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter = ThreadPool("rollstream-publish", 1)  # a produce waiting for room in a full queue
        self._room = threading.Event()
        self._waiting = 0
        # Delivery results not handed to the loop yet: appended by the thread serving the reports (the poll
        # thread; the flush at close), drained by `_hand_over` (deque: appends and pops are thread-safe).
        self._delivered: deque[tuple[asyncio.Future[Delivery], Delivery | PublishError]] = deque()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Create the producer and its poll thread. No network round trip. Idempotent."""
        if self._producer is not None:
            return
        self._loop = loop
        self._producer = open_producer(self._conf)
        self._launch(self._poll_forever, "rollstream-publish-poll")

    async def publish(self, key: bytes, value: bytes | None, *, partition: int | None = None) -> Delivery:
        """Produce one record (None: a tombstone) and wait for the broker's acknowledgement; to `partition`, or
        the key's partition (None).

        Never blocks the loop: a full local queue waits in a worker thread (until there is room or `close`).
        Returns once the record is durably written (acks=all): the await lasts until librdkafka's delivery
        report, at most its ``message.timeout.ms`` (a group's stop deadline cancels it sooner, see
        `rollstream.producers.service`). Cancelling the await does not unsend the record.
        Raises:
            PublishError: the broker rejected it (e.g. too large) or delivery timed out.
            LifecycleError: called before ``start()`` or after ``close()``.
        """
        if self._producer is None or self._loop is None:
            raise LifecycleError(f"Publisher.publish to {self.topic} before start(): call start(loop) first")
        future: asyncio.Future[Delivery] = self._loop.create_future()
        callback = self._delivery_callback(future)
        record = (key, value, -1 if partition is None else partition)  # -1: librdkafka's "by the key"
        if self._waiting:
            await self._produce_off_loop(record, callback)
        else:
            try:
                self._produce(record, callback)
            except BufferError:
                await self._produce_off_loop(record, callback)
        return await future

    async def _produce_off_loop(self, record: _Record, callback: Callable[..., None]) -> None:
        if self._on_queue_full is not None:
            self._on_queue_full()
        self._waiting += 1
        try:
            await self._waiter.run(self._produce_waiting, record, callback)
        finally:
            self._waiting -= 1

    def _produce(self, record: _Record, callback: Callable[..., None]) -> None:
        producer = self._producer
        if producer is None:
            raise LifecycleError(f"the publisher to {self.topic} is closed: publish before close(), or build a new one")
        key, value, partition = record
        try:
            producer.produce(self.topic, value=value, key=key, partition=partition, on_delivery=callback)
        except KafkaException as exc:
            err = exc.args[0]
            raise PublishError(f"cannot produce to {self.topic}: {err.str()}", topic=self.topic,
                               code=err.name(), retriable=err.retriable()) from exc

    def _produce_waiting(self, record: _Record, callback: Callable[..., None]) -> None:
        """Worker thread: retry until librdkafka's queue has room (woken by each delivery report) or `close`."""
        while True:
            self._room.clear()
            if self._stop.is_set():
                raise PublishError(f"publisher to {self.topic} closed while waiting for queue room",
                                   topic=self.topic, code="_DESTROY")
            try:
                self._produce(record, callback)
                return
            except BufferError:
                self._room.wait(0.05)

    def _delivery_callback(self, future: asyncio.Future[Delivery]) -> Callable[[Any, Any], None]:
        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            # The thread serving reports: queue the result and return at once (`_hand_over` follows).
            self._room.set()
            if err is not None:
                result: Delivery | PublishError = PublishError(
                    f"delivery to {self.topic} failed: {err.str()}", topic=self.topic, code=err.name(),
                    retriable=err.retriable())
            else:
                result = Delivery(msg.topic(), msg.partition(), msg.offset())
            self._delivered.append((future, result))

        return on_delivery

    def _hand_over(self) -> None:
        """Hand the queued delivery results to the loop in one call. Any thread; never blocks."""
        batch = []
        while self._delivered:
            batch.append(self._delivered.popleft())
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_resolve_all, batch)
        except RuntimeError:
            pass  # loop closed during shutdown; nobody awaits these any more

    def _poll_forever(self) -> None:
        producer = self._producer
        while producer is not None and not self._stop.is_set():
            producer.poll(0.1)
            self._hand_over()

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            exc = PublishError(f"fatal producer error on {self.topic}: {err.str()}", topic=self.topic,
                               code=err.name(), fatal=True)
            log.error("%s", exc)
            if self._on_fatal is not None and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self._on_fatal, exc)
                except RuntimeError:
                    pass
        else:
            log.debug("producer %s: %s", self.topic, err.str())

    def _close_up(self, producer: Producer, left: int, deadline: Deadline) -> None:
        """Join the poll thread for what is left of `deadline`; purge the `left` records the flush left (queued
        and in flight), so that nothing outlives the close waiting for a broker that does not answer, and serve
        their delivery reports. Blocks; off the loop."""
        self.join(deadline.seconds(math.inf))
        if left:
            producer.purge()
            producer.poll(0)

    def queued(self) -> int:
        """Records produced and not yet acknowledged (librdkafka's queue length)."""
        return len(self._producer) if self._producer is not None else 0

    async def close(self, timeout: float | Deadline = 30.0) -> int:
        """Flush, purge what the flush left, stop the poll thread. Idempotent. Returns the count of records never
        acknowledged (purged: their `publish` awaits fail with `PublishError`, ``_PURGE_QUEUE``).

        Blocks the caller's coroutine (never the loop) at most `timeout` (seconds, or the caller's `Deadline`) plus
        `GRACE_S`, even with the broker down or frozen: librdkafka's own ``flush(timeout)`` waits, a produce still
        waiting for queue room then fails with `PublishError` (``_DESTROY``), and the poll thread, which holds the
        client until it ends, is joined for what is left (it ends within its 0.1 s poll; the client is destroyed by
        whichever thread drops it last, never while a call on it runs).
        Raises:
            ConfigError: `timeout` is a number <= 0 (pass a `Deadline` to spend one that may have run out).
        """
        producer = self._producer
        if producer is None:
            return 0
        deadline = timeout if isinstance(timeout, Deadline) else Deadline.after(timeout)
        # Not on the worker: a produce waiting there for room would hold the flush up to message.timeout.ms.
        # Nor in asyncio's default executor, which hung user code could fill: a thread of its own.
        left = await in_thread(producer.flush, deadline.seconds(math.inf), name="rollstream-flush")
        self._stop.set()  # a produce waiting for room fails now, before a purge could make room for it
        self._room.set()
        await in_thread(self._close_up, producer, left, deadline, name="rollstream-publish-join")
        self._hand_over()  # reports the flush and the purge served
        self._producer = None
        self._waiter.retire()
        if left:
            log.error("%d records to %s were not acknowledged before the publisher closed; purged (their prompts "
                      "stay uncommitted: the next owner generates them again)", left, self.topic)
        return left


def _resolve_all(batch: list[tuple[asyncio.Future[Delivery], Delivery | PublishError]]) -> None:
    """On the loop: settle each future of `batch` with its result (a cancelled one is left)."""
    for future, result in batch:
        if future.done():
            continue
        if isinstance(result, PublishError):
            future.set_exception(result)
        else:
            future.set_result(result)
