"""`TakeTimeout`'s diagnosis: why one consumer's take (or its caller's own deadline) ran out.

The take's own view (what it looked at) is worded at once (`rollstream.consumers.forensics._status_causes`); the
cluster's (producers and prompts) comes from `rollstream.consumers.forensics._status.status`, read at most every
`refresh_s` and reused in between. Never raises: what could not be read is named in the diagnosis.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from rollstream.consumers._errors import TakeTimeout
from rollstream.consumers.forensics._status import status
from rollstream.consumers.forensics._status_causes import age, causes_of, seen_line, take_cause, unavailable_note
from rollstream.consumers.forensics._status_report import Diagnosis, StatusReport
from rollstream.infra import KafkaConfig, TopicNames
from rollstream.infra.deadline import GRACE_S
from rollstream.infra.threads import BoundedCaller
from rollstream.schemas import OffsetDisposition, now_ms

log = logging.getLogger(__name__)
_MAX_WHY = 300


class TimeoutDiagnoser:
    """The diagnosis one consumer's `TakeTimeout`s carry. Thread-safe; never raises from `diagnose`.

    The take's own view (what it looked at) is computed at once, every time. The cluster view (producers
    and prompts, via `status`, bounded by `read_timeout_s`) is rate-limited: read in a background thread
    (``rollstream-status-timeout``, which hands the parts to one kept ``rollstream-status`` thread) at most
    once every `refresh_s` per consumer, and reused in between (the diagnosis then says how old it is).
    `diagnose` waits for a read it started at most `wait_s`. `close` lets the kept thread end.
    """

    def __init__(self, config: KafkaConfig, names: TopicNames, *, producer_group: str | None = None,
                 refresh_s: float = 30.0, read_timeout_s: float = 5.0, max_prompts: int = 20_000,
                 trainer_group: str | None = None) -> None:
        self._config, self._names, self._trainer_group = config, names, trainer_group
        self._producer_group = producer_group or names.producer_group
        self._refresh_s, self._read_timeout_s, self._max_prompts = refresh_s, read_timeout_s, max_prompts
        self._lock = threading.Lock()
        self._report: StatusReport | None = None
        self._read_at: float | None = None  # when the last read ended (monotonic), successful or not
        self._reading: threading.Event | None = None
        self._caller = BoundedCaller("rollstream-status")  # kept between reads: no thread per part and read

    def close(self) -> None:
        """Let the kept reading thread end (after a read in progress). Idempotent; never blocks."""
        self._caller.close()

    def diagnose(self, seen: Sequence[OffsetDisposition], *, wait_s: float, max_staleness: int | None = None,
                 policy_version: int | None = None) -> Diagnosis:
        """The diagnosis of a take that looked at `seen` and timed out. Blocks at most about `wait_s`."""
        try:
            line, first = seen_line(seen), take_cause(seen, max_staleness, policy_version)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must never replace the timeout
            return Diagnosis(note=f"diagnosis unavailable: {type(exc).__name__}: {exc}")
        try:
            report = self._cluster_view(wait_s)
            if report is None:
                note = ("producers and prompts are being read (the next TakeTimeout carries them; or run "
                        f"'rollstream status --namespace {self._names.namespace}')")
                return Diagnosis(tuple(c for c in [first] if c), line, note)
            causes = causes_of(self._names, self._producer_group, report.producers, report.prompts, None, first,
                               trainer_group=self._trainer_group)
            notes = [n for n in [unavailable_note(report.unavailable)] if n]
            if now_ms() - report.read_at_ms > 1000:
                notes.append(f"producers and prompts as read {age(report.read_at_ms)} ago")
            return Diagnosis(causes, line, "; ".join(notes) or None, report.read_at_ms)
        except Exception as exc:  # noqa: BLE001
            return Diagnosis(tuple(c for c in [first] if c), line,
                             f"diagnosis unavailable: {type(exc).__name__}: {exc}"[:_MAX_WHY])

    def _cluster_view(self, wait_s: float) -> StatusReport | None:
        with self._lock:
            fresh = self._read_at is not None and time.monotonic() - self._read_at < self._refresh_s
            if not fresh and self._reading is None:
                self._reading = threading.Event()
                threading.Thread(target=self._read, args=(self._reading,), name="rollstream-status-timeout",
                                 daemon=True).start()
            reading = None if fresh else self._reading
        if reading is not None and wait_s > 0:
            reading.wait(wait_s)
        with self._lock:
            return self._report

    def _read(self, done: threading.Event) -> None:
        try:
            report: StatusReport | None = status(
                self._config, self._names.namespace, producer_group=self._producer_group,
                max_prompts=self._max_prompts, timeout=self._read_timeout_s, parts=("producers", "prompts"),
                caller=self._caller)
        except Exception as exc:  # noqa: BLE001 - `status` raises nothing it can read around; be sure
            log.debug("take timeout diagnosis failed: %s", exc)
            report = None
        with self._lock:
            if report is not None:
                self._report = report
            self._read_at = time.monotonic()  # a failed read also waits `refresh_s`: no storm of reads
            self._reading = None
        done.set()


class TakeTimeouts:
    """The `TakeTimeout`s of one consumer: what its last `poll_batch` looked at (for `last_poll`) and why it
    or a take ran out (a `TimeoutDiagnoser`, created at the first timeout). Not thread-safe (the consumer's
    thread). `error` and `last_poll` never raise; `close` is idempotent and never blocks."""

    def __init__(self, names: TopicNames, trainer_group: str | None = None) -> None:
        self._names, self._trainer_group = names, trainer_group
        self._diagnoser: TimeoutDiagnoser | None = None
        self._last_poll: tuple[tuple[OffsetDisposition, ...], int] = ((), 0)

    def polled(self, seen: Sequence[OffsetDisposition] = (), gathered: int = 0) -> None:
        """What the last poll looked at and gathered (nothing: a poll or take that returned a batch)."""
        self._last_poll = (tuple(seen), gathered)

    def error(self, config: KafkaConfig, n: int, gathered: int, timeout: float | None,
              seen: Sequence[OffsetDisposition], *, max_staleness: int | None,
              policy_version: int | None) -> TakeTimeout:
        """The timeout of a take of `n` that gathered `gathered` after looking at `seen`, diagnosed (the
        cluster read at most every 30 s; waits at most a quarter of `timeout` and half of `GRACE_S` for it: a
        timed-out take raises within its deadline's grace)."""
        try:
            diagnoser = self._diagnoser
            if diagnoser is None:
                diagnoser = self._diagnoser = TimeoutDiagnoser(config, self._names, trainer_group=self._trainer_group)
            why: Diagnosis | str = diagnoser.diagnose(seen, wait_s=min(GRACE_S / 2, (timeout or 0.0) / 4),
                                                      max_staleness=max_staleness, policy_version=policy_version)
        except Exception as exc:  # noqa: BLE001 - the timeout must be raised, whatever the diagnosis does
            why = f"Why: diagnosis unavailable ({type(exc).__name__}: {exc})"
        return TakeTimeout(n, gathered, timeout or 0.0, why)

    def last_poll(self, config: KafkaConfig, n: int, timeout: float, *, max_staleness: int | None,
                  policy_version: int | None) -> TakeTimeout:
        """`error` for what the last poll that returned None looked at and gathered."""
        seen, gathered = self._last_poll
        return self.error(config, n, gathered, timeout, seen, max_staleness=max_staleness,
                          policy_version=policy_version)

    def close(self) -> None:
        if self._diagnoser is not None:
            self._diagnoser.close()
