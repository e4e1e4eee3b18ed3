"""`rollstream.cli._stopping.StopSignals`: a stop signal is recorded whatever it becomes, exits 128 + signum, and
a second one is left to the kernel (the default action), which ends the process whatever the main thread does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rollstream.cli._stopping import StopSignals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_raises_keyboard_interrupt_and_is_recorded(sig: signal.Signals) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopSignals("test", grace_s=3600)  # the deadline must not end the test run
    try:
        with pytest.raises(KeyboardInterrupt), stop:
            assert stop.signalled is None
            os.kill(os.getpid(), sig)
            for _ in range(1000):  # the handler runs at the next bytecode boundary of the main thread
                pass
        assert stop.signalled == sig and stop.exit_code == 128 + sig
        # A second signal is the kernel's: the default action, not a handler waiting for the main thread.
        assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_without_a_signal_the_previous_handlers_come_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals("test") as stop:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert stop.signalled is None and stop.exit_code == 130
    assert {s: signal.getsignal(s) for s in before} == before


_BLOCKED_IN_LIBRDKAFKA = """
from confluent_kafka import Producer
from rollstream.cli._stopping import StopSignals
producer = Producer({"bootstrap.servers": "127.0.0.1:1", "transactional.id": "blocked"})
with StopSignals("blocked", grace_s=1.0):
    print("ready", flush=True)
    producer.init_transactions(60)  # no Python code runs in the main thread for up to 60 s
"""


def test_the_deadline_starts_while_the_main_thread_is_blocked_in_librdkafka() -> None:
    """A signal that arrives while the main thread is inside a blocking librdkafka call (a transactional commit)
    starts the hard-exit deadline at once: the Python handler would only run once the call returned."""
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_IN_LIBRDKAFKA], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and took < 10, (proc.returncode, took, stderr[-2000:])
    assert "interrupted (SIGTERM)" in stderr and "did not stop within 1 s" in stderr
