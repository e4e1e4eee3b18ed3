"""Ctrl-C (SIGINT) and SIGTERM stop a long-running command within a bound, whatever the broker did.

The first signal raises KeyboardInterrupt in the main thread, so the command closes what it opened on the
way out (`with` blocks: Kafka clients, output files), and starts a deadline: once it passes, the process
ends at once with ``128 + signum`` (130 for SIGINT, 143 for SIGTERM). A second signal ends it at once too: the
first puts back the system's default action for both, which the kernel carries out whatever the main thread
is blocked in (a Python handler would wait for the blocking librdkafka call to return). Commands
that use this are kill-safe by design (`rollstream take` writes each step before committing it), so a hard
exit loses nothing a SIGKILL would not.

Why not trust KeyboardInterrupt alone: Python runs the handler wherever the main thread next runs Python
code, and inside a blocking librdkafka call that is a callback (a librdkafka log line forwarded to the
``librdkafka`` logger, a delivery report) served by ``consume()`` or ``flush()``. confluent-kafka 2.16 then
loses the KeyboardInterrupt: the call raises ``SystemError: ... returned NULL without setting an
exception`` instead (seen in most runs with the broker down or just restarted, when librdkafka logs most).
So the command asks `signalled` which signal came and exits with its code whatever the shutdown raised.
And a close that waits on a broker which does not answer, or a client left to librdkafka at interpreter
exit, can no longer hold the process: after the shutdown the command leaves with `exit_now`.

The deadline starts when the signal arrives, not when the main thread next runs Python code: a blocking
librdkafka call (a transactional commit waits up to the consumer's timeout) would hold the Python handler back
for that long. Python's C-level handler writes each signal's number to a wakeup pipe
(``signal.set_wakeup_fd``) at once, and a watcher thread (``rollstream-stop-signals``) reading it starts the
deadline. Where something else owns the wakeup fd (an asyncio loop's signal handlers), the handler starts it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SHUTDOWN_GRACE_S = 15.0  # from the first signal to a hard exit; each close on the way out is bounded well below


class StopSignals:
    """Within the `with` block, SIGINT and SIGTERM stop the command as the module docstring says.

    Installs its handlers on enter (only from the main thread; elsewhere it does nothing) and puts the
    previous ones back on exit unless a signal came (a second one must still end the process). The deadline,
    once started, runs until the process ends. Not reentrant.
    """

    def __init__(self, what: str, *, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.what = what
        self.grace_s = grace_s
        self.signalled: int | None = None  # the first stop signal received
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._pipe: tuple[int, int] | None = None  # the wakeup pipe the watcher reads (read end, write end)
        self._previous_wakeup_fd = -1

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 SIGINT, 143 SIGTERM); 130 when none came (a KeyboardInterrupt)."""
        return 128 + (self.signalled or signal.SIGINT)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            self._watch()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.signalled is None:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
        self._previous.clear()
        self._unwatch()

    def _watch(self) -> None:
        """Route signal numbers to a pipe the watcher thread reads, unless another wakeup fd is in use."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop's): leave it, the handler starts the deadline
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return
        self._pipe = (read_end, write_end)
        threading.Thread(target=self._read_signals, args=(read_end,), name="rollstream-stop-signals",
                         daemon=True).start()

    def _unwatch(self) -> None:
        if self._pipe is None:
            return
        read_end, write_end = self._pipe
        self._pipe = None
        signal.set_wakeup_fd(-1)
        os.write(write_end, b"\0")  # ends the watcher, which closes the read end
        os.close(write_end)

    def _read_signals(self, read_end: int) -> None:
        seen = 0  # each signal writes its number once
        try:
            while (data := os.read(read_end, 64)) and 0 not in data:
                for signum in data:
                    if signum not in STOP_SIGNALS:
                        continue
                    seen += 1
                    self._start_deadline(signum)
                    if seen > 1:  # a second one while the main thread may still be blocked, before its handler
                        # could put the default action back: end it now, as the kernel would have
                        self._exit(self.exit_code, f"interrupted ({signal.Signals(signum).name} again): exiting now")
        finally:
            os.close(read_end)

    def _start_deadline(self, signum: int) -> None:
        """Note the first stop signal and start the hard-exit deadline (once). Any thread."""
        with self._lock:
            if self.signalled is not None:
                return
            self.signalled = signum
        name = signal.Signals(signum).name
        deadline = threading.Timer(self.grace_s, self._exit, (
            128 + signum, f"interrupted ({name}): {self.what} did not stop within {self.grace_s:g} s: exiting now"))
        deadline.daemon = True
        deadline.start()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._start_deadline(signum)
        for sig in STOP_SIGNALS:  # a second signal: the kernel ends the process, now
            signal.signal(sig, signal.SIG_DFL)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def exit_now(self, message: str) -> None:
        """Print `message` and end the process with `exit_code` without the interpreter's own shutdown (which
        would destroy every Kafka client still open, each waiting on the broker). Flushes stdout first."""
        self._exit(self.exit_code, message)

    @staticmethod
    def _exit(code: int, message: str) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or a pipe whose reader is gone: nothing more to say there
                pass
        try:
            os.write(2, f"{message}\n".encode())
        except OSError:
            pass
        os._exit(code)
