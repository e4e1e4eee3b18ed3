"""The one replaceable-client policy (`rollstream.infra._replaceable.ClientReplacement`, librdkafka#5511). Four
behaviours:

1. When: every ``after_failures``-th failure in a row replaces the client (also the 2nd, 3rd ... multiple
   while failures go on); a success ends the streak and says how long it was.
2. How: the new client is opened and installed before the old one is closed, and that close runs in the
   background: a close that hangs (a client without a coordinator) never holds the owner.
3. Count: ``replacements`` and ``on_replace(cause)`` once per replacement; a failed open keeps the old client.
4. ``close_quietly`` waits at most ``wait_s`` and swallows a close's Kafka error.
"""

from __future__ import annotations

import threading
import time

import pytest
from confluent_kafka import KafkaError, KafkaException
from rollstream.infra._replaceable import ClientReplacement, close_quietly
from rollstream.schemas import ConfigError


class _Client:
    def __init__(self, n: int, hang: threading.Event | None = None) -> None:
        self.n, self.hang, self.closed = n, hang, threading.Event()

    def close(self) -> None:
        if self.hang is not None:
            self.hang.wait()
        self.closed.set()


class _Owner:
    def __init__(self, hang: threading.Event | None = None) -> None:
        self.opened = 0
        self.current: _Client | None = None
        self.causes: list[object] = []
        self.hang = hang
        self.policy = ClientReplacement[_Client](
            "test", open_client=self.open, swap=self.swap, close_client=_Client.close, after_failures=3,
            on_replace=self.causes.append)

    def open(self) -> _Client:
        self.opened += 1
        return _Client(self.opened, self.hang)

    def swap(self, fresh: _Client) -> _Client | None:
        stale, self.current = self.current, fresh
        return stale


def test_every_nth_failure_in_a_row_replaces_and_a_success_ends_the_streak() -> None:
    owner = _Owner()
    owner.current = first = owner.open()
    assert [owner.policy.failed(f"e{i}") for i in range(2)] == [None, None] and owner.current is first
    fresh = owner.policy.failed("e2")
    assert fresh is owner.current and fresh is not first and owner.policy.replacements == 1
    assert first.closed.wait(5), "the replaced client is closed (in the background)"
    assert owner.causes == ["e2"]
    assert [owner.policy.failed(f"e{i}") for i in range(3, 5)] == [None, None]
    assert owner.policy.failed("e5") is owner.current and owner.policy.replacements == 2  # the 6th in a row
    assert owner.policy.succeeded() == 6 and owner.policy.failures == 0
    assert owner.policy.succeeded() == 0
    assert [owner.policy.failed(f"f{i}") for i in range(2)] == [None, None]  # a new streak starts at 0
    assert owner.policy.replacements == 2 and owner.causes == ["e2", "e5"]


def test_a_close_that_hangs_never_holds_the_owner() -> None:
    hang = threading.Event()
    owner = _Owner(hang)
    owner.current = stuck = owner.open()
    try:
        began = time.monotonic()
        owner.policy.replace("stuck")
        assert time.monotonic() - began < 1.0 and owner.current is not stuck
        assert not stuck.closed.is_set()  # still closing, in its own thread
        assert any(t.name.startswith("rollstream-close-stale-test") for t in threading.enumerate())
    finally:
        hang.set()
    assert stuck.closed.wait(5)


def test_a_failed_open_keeps_the_old_client_and_counts_nothing() -> None:
    owner = _Owner()
    owner.current = first = owner.open()

    def refuse() -> _Client:
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG))

    owner.policy._open = refuse
    with pytest.raises(KafkaException):
        owner.policy.replace("x")
    assert owner.current is first and owner.policy.replacements == 0 and owner.causes == []


def test_after_failures_must_be_a_positive_count() -> None:
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="after_failures"):
            ClientReplacement("x", open_client=object, swap=lambda c: None, close_client=lambda c: None,
                              after_failures=bad)  # type: ignore[arg-type]


def test_close_quietly_waits_at_most_wait_s_and_swallows_kafka_errors() -> None:
    def fails() -> None:
        raise KafkaException(KafkaError(KafkaError._DESTROY))

    assert close_quietly(fails, "fails", wait_s=5.0) is True
    release = threading.Event()
    began = time.monotonic()
    assert close_quietly(release.wait, "hangs", wait_s=0.2) is False
    assert time.monotonic() - began < 2.0
    release.set()
