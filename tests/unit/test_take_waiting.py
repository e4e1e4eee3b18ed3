"""A waiting `rollstream take` says so (rollstream.cli._waiting): when its lines come, what they say, and that the
take still returns its batch or raises its timeout as `take` does. A fake consumer stands in for the broker; the
real one is in tests/integration/test_first_day_errors.py (test_f)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from rollstream.consumers import Diagnosis, TakeTimeout
from rollstream.consumers.forensics._status_report import Cause
from rollstream.infra import KafkaIOError, MissingNamespaceError, UnreachableClusterError
from rollstream.schemas import ConfigError

from rollstream.cli._waiting import NOTICES_ENV, WaitNotices, connect_saying_why, take_saying_why, waiting_line


def test_lines_come_after_30_s_then_with_a_doubling_gap_up_to_5_min() -> None:
    assert list(itertools.islice(WaitNotices().times(), 7)) == [30, 90, 210, 450, 750, 1050, 1350]
    assert list(itertools.islice(WaitNotices(1, 3).times(), 5)) == [1, 3, 6, 9, 12]


def test_the_env_var_shortens_them_and_a_bad_value_is_one_config_error() -> None:
    assert WaitNotices.from_env({}) == WaitNotices()
    assert WaitNotices.from_env({NOTICES_ENV: "0.5,2"}) == WaitNotices(0.5, 2)
    for bad in ("5", "a,b", "3,1", "0,1"):
        with pytest.raises(ConfigError, match="FIRST,LONGEST|first="):
            WaitNotices.from_env({NOTICES_ENV: bad})


def test_the_line_says_how_long_how_many_and_why_with_the_fix() -> None:
    why = Diagnosis((Cause("no_producer", True, "0 producers in ns.producers: start one with 'rollstream produce "
                           "--namespace ns ...'"),), "looked at no group (none arrived)")
    line = waiting_line(TakeTimeout(8, 3, 150.0, why), 150.0, 2)
    assert line.startswith("take waiting for 2.5 min: 3 of 8 groups so far (step not taken yet; 2 committed before")
    assert "why: 0 producers in ns.producers: start one with 'rollstream produce --namespace ns ...'" in line
    assert line.endswith("(this take looked at no group (none arrived))") and "\n" not in line
    assert "why: are producers running?" in waiting_line(TakeTimeout(8, 0, 30.0), 30.0, 0)


class _Fake:
    """connect: records its timeout; poll_batch: a batch once `ready_after` s have passed (else None after its
    slice); timeout_error records."""

    def __init__(self, ready_after: float) -> None:
        self.started, self.ready_after = time.monotonic(), ready_after
        self.slices: list[float] = []
        self.errors: list[float] = []

    def connect(self, timeout: float | None = None) -> None:
        self.connected = timeout

    def poll_batch(self, n: int, timeout: float, commit: bool = True) -> Any:
        assert not commit and timeout >= 0
        self.slices.append(timeout)
        time.sleep(max(0.0, min(timeout, self.started + self.ready_after - time.monotonic())))
        return "batch" if time.monotonic() - self.started >= self.ready_after else None

    def timeout_error(self, n: int, timeout: float) -> TakeTimeout:
        self.errors.append(timeout)
        return TakeTimeout(n, 1, timeout, Diagnosis((Cause("no_prompts", False, "ns.prompts is empty: load"),)))


def test_a_take_that_waits_prints_lines_then_returns_its_batch() -> None:
    fake, said = _Fake(ready_after=0.5), []
    batch = take_saying_why(fake, 4, None, WaitNotices(0.1, 0.2), said.append)  # type: ignore[arg-type]
    assert batch == "batch" and 2 <= len(said) <= 4, said
    assert all(line.startswith("take waiting for 0 s: 1 of 4 groups") and "why: ns.prompts is empty" in line
               for line in said)
    assert fake.errors[0] == 0.0  # the cluster read started ahead, waiting for nothing


def test_a_take_with_a_timeout_raises_it_diagnosed_and_says_why_before() -> None:
    fake, said = _Fake(ready_after=60), []
    started = time.monotonic()
    with pytest.raises(TakeTimeout) as caught:
        take_saying_why(fake, 4, 0.35, WaitNotices(0.1, 0.1), said.append)  # type: ignore[arg-type]
    assert 0.35 <= time.monotonic() - started < 2 and caught.value.timeout == 0.35
    assert fake.errors[-1] == 0.35 and 2 <= len(said) <= 3, said


def test_a_batch_already_there_prints_nothing() -> None:
    fake, said = _Fake(ready_after=0), []
    assert take_saying_why(fake, 4, None, WaitNotices(), said.append) == "batch"  # type: ignore[arg-type]
    assert said == [] and fake.errors == []


class _Refusing:
    """connect: raises each of `errors` in turn (immediately), then connects; records the timeouts it was given."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.timeouts = list(errors), []  # type: list[Exception], list[float | None]

    def connect(self, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)
        if self.errors:
            raise self.errors.pop(0)


_LOADING = KafkaIOError("cannot read committed offsets on ns.rollouts: Local: Timed out", code="_TIMED_OUT",
                        retriable=True)


def test_a_take_without_timeout_connects_again_after_retriable_failures_saying_so(monkeypatch: Any) -> None:
    monkeypatch.setattr("rollstream.cli._waiting._CONNECT_PAUSE_S", 0.05)
    fake, said = _Refusing(_LOADING, _LOADING), []
    connect_saying_why(fake, None, said.append)  # type: ignore[arg-type]
    assert fake.timeouts == [None, None, None] and len(said) == 2
    assert all(line.startswith("cannot connect yet, trying again") and "Timed out" in line for line in said)


def test_a_connect_failure_that_is_not_retriable_or_outlasts_the_timeout_is_raised(monkeypatch: Any) -> None:
    monkeypatch.setattr("rollstream.cli._waiting._CONNECT_PAUSE_S", 0.05)
    missing = MissingNamespaceError("namespace ns has no topics: rollstream topics create --namespace ns",
                                    namespace="ns", existing=[])
    with pytest.raises(MissingNamespaceError):
        connect_saying_why(_Refusing(missing), None, [].append)  # type: ignore[arg-type]
    unreachable = UnreachableClusterError("cannot reach Kafka at 127.0.0.1:1 within 15 s", retriable=True)
    with pytest.raises(UnreachableClusterError):  # never reached: said at once, not waited for
        connect_saying_why(_Refusing(unreachable), None, [].append)  # type: ignore[arg-type]
    fake, started = _Refusing(*[_LOADING] * 100), time.monotonic()
    with pytest.raises(KafkaIOError, match="Timed out"):
        connect_saying_why(fake, 0.3, [].append)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0 and 2 <= len(fake.timeouts) <= 8
    assert fake.timeouts[0] == pytest.approx(0.3, abs=0.01)
    assert all(t is not None and 0 <= t <= 0.3 for t in fake.timeouts)
