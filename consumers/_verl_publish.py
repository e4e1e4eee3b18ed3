"""Many acknowledged publishes in flight at once, for verl's rollouter (`_verl_rollouter.VerlRolloutQueue`).

`AckedPublisher.send` hands a record to librdkafka and returns a future that resolves when the broker
acknowledged it (acks=all, idempotent: durable, never duplicated by a retry) or failed it. It never waits for
the acknowledgement itself, so every sample verl generates concurrently is in flight at once; each caller
still awaits its own future before verl counts its sample as produced. Before, one thread produced a
sample and polled until its acknowledgement came (one linger plus one round trip per sample, all in a row).

- librdkafka keeps the deadline: the producer's ``message.timeout.ms`` is ``timeout_s``, so every future is
  resolved (acknowledged or failed with ``_MSG_TIMED_OUT``) within it; nothing abandons a call in the library.
- Delivery reports are served by one thread (``rollstream-verl-acks``) polling the producer; a report only
  sets its future (thread-safe), it never blocks.
- Order per partition is librdkafka's (idempotent: retries keep it). `drain` waits until every record sent
  before it is resolved: the end marker goes after every sample.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from rollstream.infra.clients import open_producer
from rollstream.infra.threads import WorkerThread
from rollstream.schemas import RollstreamError

_POLL_S = 0.05  # how long one poll waits for a report: bounds how late `stop` is seen


class PublishFailed(RollstreamError):
    """A verl sample was not acknowledged within ``kafka_timeout_s``, or librdkafka refused it; retriable unless
    fatal."""


class AckedPublisher(WorkerThread):
    """One idempotent producer with any number of records in flight. `send` and `drain` are thread-safe;
    no network before the first `send`."""

    def __init__(self, conf: Mapping[str, Any], topic: str, timeout_s: float) -> None:
        super().__init__()
        self.topic, self.timeout_s = topic, timeout_s
        self._conf = {**conf, "message.timeout.ms": max(1, int(timeout_s * 1000))}
        self._producer: Any = None
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[None]] = set()

    def send(self, key: str, value: bytes) -> concurrent.futures.Future[None]:
        """Queue `value` for the topic; never waits for the broker (only, when librdkafka's queue is full, for
        room, at most ``timeout_s``). The future resolves to None once acknowledged, else to `PublishFailed`.

        Raises:
            PublishFailed: no room in librdkafka's queue within ``timeout_s``, or librdkafka refused the record;
                ConfigError on a bad property.
        """
        with self._lock:
            if self._producer is None:
                self._producer = open_producer(self._conf)
                self._launch(self._serve_reports, "rollstream-verl-acks")
            producer = self._producer
            future: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._pending.add(future)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                producer.produce(self.topic, key=key.encode(), value=value,
                                 on_delivery=lambda err, _msg: self._resolve(future, key, err))
                return future
            except BufferError:  # librdkafka's queue is full: reports make room (served by the acks thread)
                if time.monotonic() >= deadline:
                    return self._refuse(future, key, f"librdkafka's queue stayed full for {self.timeout_s} s", None)
                time.sleep(_POLL_S)
            except KafkaException as exc:  # refused before it was queued (a fatal producer error, a bad record)
                return self._refuse(future, key, str(exc), exc.args[0] if exc.args else None)

    def drain(self, timeout_s: float) -> bool:
        """Block up to `timeout_s` until every record sent so far is acknowledged or failed; True if so.

        Watches the records (a report takes its future out of the pending set), not the futures' states: a future
        whose awaiting caller was cancelled (an episode cancelled at shutdown) is never done for
        `concurrent.futures.wait`, though its record was acknowledged."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            waiting = set(self._pending)
        while True:
            with self._lock:
                waiting &= self._pending
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return not waiting
            time.sleep(min(_POLL_S, left))

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for what is in flight, then stop the acks thread. Idempotent."""
        if self._producer is not None:
            self.drain(timeout_s)
        self.stop()
        self.join(timeout_s)

    def _refuse(self, future: concurrent.futures.Future[None], key: str, reason: str, err: Any) -> Any:
        self._resolve(future, key, err if isinstance(err, KafkaError) else None, reason=reason)
        raise future.exception()  # type: ignore[misc]

    def _resolve(self, future: concurrent.futures.Future[None], key: str, err: KafkaError | None,
                 reason: str | None = None) -> None:
        with self._lock:
            self._pending.discard(future)
        try:
            if err is None and reason is None:
                future.set_result(None)
                return
            fatal = bool(err is not None and err.fatal())
            why = reason or (err.str() if err is not None else "failed")
            if err is not None and err.code() == KafkaError._MSG_TIMED_OUT:
                why += (f" (no acknowledgement within {self.timeout_s} s: is the broker reachable and {self.topic} "
                        "created? `rollstream topics create`)")
            future.set_exception(PublishFailed(f"verl sample {key} to {self.topic}: {why}", retriable=not fatal))
        except concurrent.futures.InvalidStateError:  # its awaiting caller was cancelled: nobody is told
            pass

    def _serve_reports(self) -> None:
        while not self._stop.is_set():
            self._producer.poll(_POLL_S)
        self._producer.flush(0)
