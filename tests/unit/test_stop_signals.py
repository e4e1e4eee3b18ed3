"""`rollstream.cli._stopping.StopSignals`: a stop signal is recorded whatever it becomes, exits 128 + signum, and
a second one is left to the kernel (the default action), which ends the process whatever the main thread does."""

from __future__ import annotations

import os
import signal

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
