"""The supervised client processes of a chaos run: `rollstream produce` and `rollstream take` subprocesses.

Each `Role` is one logical process (a producer with a stable ``--producer-id``, or the trainer) that the
nemesis may SIGKILL (it is restarted later with the same arguments) or SIGSTOP (SIGCONT later). Output
goes to one log file per role, appended across restarts, so a failed run can be read afterwards.

Every end of a process the nemesis did not SIGKILL is judged (`Role.bad_exit`): death by any other signal
(SIGABRT from an assertion inside librdkafka, SIGSEGV) or a Python traceback in that process life's output
is a failure of the run, reported with the tail of its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration._kafka import REPO_ROOT, cli_env

GEN_DELAY_S = "0.05"  # per group (tests.plugins:slow): many groups flow, and a kill still lands mid-group


@dataclass
class Role:
    """One supervised process: its command line, its state as the nemesis left it, and its restarts."""

    name: str
    args: tuple[str, ...]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False  # SIGSTOPped and not yet continued
    starts: int = 0
    exits: list[int] = field(default_factory=list)  # return codes of runs that ended on their own
    module: str = "rollstream"  # run as ``python -m MODULE ARGS``
    _log_from: int = 0  # where the current process life's output begins in `log_path`

    def start(self) -> None:
        """Start (or restart) the process; its output is appended to `log_path`."""
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self._log_from = log.tell()
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], cwd=REPO_ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        self.starts += 1
        self.stopped = False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> int | None:
        """The return code if the process ended since the last look (recorded in `exits`), else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        self.exits.append(code)
        self.proc, self.stopped = None, False
        return code

    def signal(self, sig: signal.Signals) -> bool:
        """Send `sig` to the live process; True if it was delivered. SIGKILL also reaps it."""
        if not self.alive or self.proc is None:
            return False
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGKILL:
            self.proc.wait(timeout=30)
            self.proc, self.stopped = None, False
        elif sig == signal.SIGSTOP:
            self.stopped = True
        elif sig == signal.SIGCONT:
            self.stopped = False
        return True

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to `timeout_s` for the process to end on its own; its return code, or None if it still runs."""
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
        self.exits.append(code)
        self.proc = None
        return code

    def terminate(self, timeout_s: float = 30.0) -> str | None:
        """Continue it if stopped, SIGTERM (SIGINT for the trainer, which it handles), then SIGKILL if it lingers.
        Returns what was wrong with how it ended (`bad_exit`; a SIGKILL here is ours), or None."""
        if not self.alive or self.proc is None:
            return None
        if self.stopped:
            self.signal(signal.SIGCONT)
        sent = signal.SIGINT if self.name == "trainer" else signal.SIGTERM
        self.proc.send_signal(sent)
        code = self.wait(timeout_s)
        if code is None:
            self.signal(signal.SIGKILL)
            return None
        return self.bad_exit(code, allowed=frozenset({-sent}))

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def life_output(self) -> str:
        """The output of the current (or just ended) process life."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as log:
            log.seek(self._log_from)
            return log.read().decode(errors="replace")

    def bad_exit(self, code: int, *, allowed: frozenset[int] = frozenset()) -> str | None:
        """What was wrong with the process life that just ended with `code` (`allowed`: the negative codes of
        signals we sent it, e.g. -SIGTERM at the end), or None when nothing was: a signal we did not send, or a
        Python traceback in its output, is wrong. Call before the next `start`."""
        output = self.life_output()
        if code < 0 and code not in allowed:
            why = f"killed by {signal.Signals(-code).name}, a signal the nemesis did not send"
        elif "Traceback (most recent call last)" in output:
            why = f"exited with rc {code} and a Python traceback"
        else:
            return None
        tail = "\n".join(output.splitlines()[-25:])
        return f"{self.name} (start {self.starts}, log {self.log_path}) {why}:\n{tail}"


def producer_role(name: str, bootstrap: str, namespace: str, group: str, log_dir: Path, *,
                  exit_when_idle_s: float | None = None, gen_delay_s: str = GEN_DELAY_S,
                  extra: tuple[str, ...] = ()) -> Role:
    """`rollstream produce` with the slow test engine, a stable producer id, and generous startup; `extra`
    appended (``--kafka-config FILE`` against a TLS broker)."""
    args = ["produce", "-N", namespace, "--generate", "tests.plugins:slow", "--reward", "tests.plugins:reward",
            "--n-samples", "2", "--concurrency", "4", "--max-lag", "400", "--trainer-group", group,
            "--producer-id", name, "--startup-timeout", "60", "--summary-interval", "0"]
    if exit_when_idle_s is not None:
        args += ["--exit-when-idle", f"{exit_when_idle_s:g}"]
    args += extra
    return Role(name, tuple(args), cli_env(bootstrap, ROLLSTREAM_TEST_GEN_DELAY_S=gen_delay_s),
                log_dir / f"{name}.log")


def loop_trainer_role(bootstrap: str, namespace: str, group: str, out: Path, log_dir: Path, *, n: int,
                      timeout_s: float) -> Role:
    """`tests.chaos._trainer`: one long-lived process taking N groups with ``commit=False`` (take timeout and
    consumer timeout `timeout_s`), appending to `out`, then committing each step; timeouts and failed commits
    are retried in the process, as a training job would."""
    args = (bootstrap, namespace, group, str(n), str(out), f"{timeout_s:g}")
    return Role("trainer", args, cli_env(bootstrap), log_dir / "trainer.log", module="tests.chaos._trainer")


def trainer_role(bootstrap: str, namespace: str, group: str, out: Path, log_dir: Path, *, n: int,
                 steps: int = 0, name: str = "trainer", extra: tuple[str, ...] = ()) -> Role:
    """`rollstream take -n N` appending to `out`; no dynamic sampling (the test reward is always 1.0, so
    every group would be filtered) and no per-step timeout (a step may wait out a long broker pause)."""
    args = ("take", "-n", str(n), "--steps", str(steps), "-N", namespace, "--group", group, "--out", str(out),
            "--no-dynamic-sampling", *extra)
    return Role(name, args, cli_env(bootstrap), log_dir / f"{name}.log")
