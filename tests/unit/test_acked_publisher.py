"""`AckedPublisher.drain` (the verl and AReaL adapters' publisher) without a broker: it waits for the records, not
their futures' states, so a record whose awaiting caller was cancelled (an episode cancelled at shutdown) stops
holding it up once its report came, instead of until the timeout."""

from __future__ import annotations

import concurrent.futures
import threading
import time

from rollstream.consumers._verl_publish import AckedPublisher


def test_drain_returns_once_the_records_are_reported_also_for_a_cancelled_caller() -> None:
    publisher = AckedPublisher({"bootstrap.servers": "127.0.0.1:1"}, "t.rollouts", timeout_s=5.0)
    cancelled: concurrent.futures.Future[None] = concurrent.futures.Future()
    cancelled.cancel()  # what asyncio.wrap_future does to it when the awaiting task is cancelled
    publisher._pending.add(cancelled)
    report = threading.Timer(0.2, publisher._resolve, (cancelled, "k", None))  # the delivery report arrives
    report.start()
    started = time.monotonic()
    assert publisher.drain(5.0)
    assert 0.15 < time.monotonic() - started < 2.0 and publisher.in_flight == 0
    report.join()


def test_drain_times_out_while_a_record_is_unreported() -> None:
    publisher = AckedPublisher({"bootstrap.servers": "127.0.0.1:1"}, "t.rollouts", timeout_s=5.0)
    publisher._pending.add(concurrent.futures.Future())
    started = time.monotonic()
    assert not publisher.drain(0.3)
    assert 0.25 < time.monotonic() - started < 2.0
