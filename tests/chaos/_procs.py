"""The supervised client processes of a chaos run: `rollstream produce` and `rollstream take` subprocesses.

Each `Role` is one logical process (a producer with a stable ``--producer-id``, or the trainer) that the
nemesis may SIGKILL (it is restarted later with the same arguments) or SIGSTOP (SIGCONT later). Output
goes to one log file per role, appended across restarts, so a failed run can be read afterwards.
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

    def start(self) -> None:
        """Start (or restart) the process; its output is appended to `log_path`."""
        with self.log_path.open("ab") as log:
            log.write(f"--- start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, "-m", "rollstream", *self.args], cwd=REPO_ROOT,
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

    def terminate(self, timeout_s: float = 30.0) -> None:
        """Continue it if stopped, SIGTERM (SIGINT for the trainer, which it handles), then SIGKILL if it lingers."""
        if not self.alive or self.proc is None:
            return
        if self.stopped:
            self.signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGINT if self.name == "trainer" else signal.SIGTERM)
        if self.wait(timeout_s) is None:
            self.signal(signal.SIGKILL)

    def tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


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


def trainer_role(bootstrap: str, namespace: str, group: str, out: Path, log_dir: Path, *, n: int,
                 steps: int = 0, name: str = "trainer", extra: tuple[str, ...] = ()) -> Role:
    """`rollstream take -n N` appending to `out`; no dynamic sampling (the test reward is always 1.0, so
    every group would be filtered) and no per-step timeout (a step may wait out a long broker pause)."""
    args = ("take", "-n", str(n), "--steps", str(steps), "-N", namespace, "--group", group, "--out", str(out),
            "--no-dynamic-sampling", *extra)
    return Role(name, args, cli_env(bootstrap), log_dir / f"{name}.log")
