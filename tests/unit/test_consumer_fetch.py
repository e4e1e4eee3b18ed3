"""One fetch that returns records around an error event keeps every record (no broker: a stand-in client).

librdkafka hands error events and records in the same batch. Records after the error are already consumed
from librdkafka: if they were not buffered, a take retried after the error would skip their offsets.
"""

from __future__ import annotations

import pytest

from consumers import RolloutConsumer
from infra import KafkaConfig
from schemas import RollstreamError


class _Error:
    def code(self) -> int:
        return -1

    def fatal(self) -> bool:
        return False

    def retriable(self) -> bool:
        return False

    def name(self) -> str:
        return "TOPIC_AUTHORIZATION_FAILED"

    def str(self) -> str:
        return "Broker: Topic authorization failed"


class _Message:
    def __init__(self, offset: int, error: _Error | None = None) -> None:
        self._offset, self._error = offset, error

    def error(self) -> _Error | None:
        return self._error

    def topic(self) -> str:
        return "ns.rollouts"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"k"

    def value(self) -> bytes:
        return b"v"


class _Client:
    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        return [_Message(0), _Message(-1, _Error()), _Message(1)]

    def close(self) -> None:
        pass


def test_records_after_an_error_event_stay_buffered() -> None:
    consumer = RolloutConsumer(config=KafkaConfig(client_id="unit"), group_id="g", namespace="ns")
    consumer._consumer = _Client()  # type: ignore[assignment]
    with consumer, pytest.raises(RollstreamError, match="authorization"):
        consumer._fetch(10, 0.0)
    assert [e.offset for e in consumer._buffer] == [0, 1]
