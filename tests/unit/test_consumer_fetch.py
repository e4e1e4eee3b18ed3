"""One fetch that returns records around an error event keeps every record (no broker: a stand-in client).

librdkafka hands error events and records in the same batch. Records after the error are already consumed
from librdkafka: if they were not buffered, a take retried after the error would skip their offsets.
"""

from __future__ import annotations

from collections import deque

import pytest
from rollstream.consumers._client import TrainerClient
from rollstream.consumers._gather import Entry
from rollstream.schemas import RollstreamError


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
    def assign(self, partitions: list[object]) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        return [_Message(0), _Message(-1, _Error()), _Message(1)]

    def close(self) -> None:
        pass


def test_records_after_an_error_event_stay_buffered() -> None:
    client = TrainerClient("g", "ns.rollouts", {})
    client.use(_Client(), {})  # type: ignore[arg-type]
    buffer: deque[Entry] = deque()
    with pytest.raises(RollstreamError, match="authorization"):
        client.fetch_into(buffer, 10, 0.0)
    assert [e.offset for e in buffer] == [0, 1]
