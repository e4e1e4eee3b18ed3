"""What the demo starts besides the trainer: a local broker (when none is given) and producer processes.

Both are context managers that stop what they started when the block exits, also on Ctrl-C or an error:
`LocalBroker` stops the broker it started (and removes its data dir) unless asked to keep it;
`ProducerFleet` sends SIGTERM to each producer, waits for its drain, then SIGKILLs what is left.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from rollstream.infra import BOOTSTRAP_ENV
from rollstream.infra.broker import (
    BrokerSpec,
    broker_status,
    client_config_files,
    free_port,
    start_broker,
    stop_broker,
)
from rollstream.schemas import RollstreamError

log = logging.getLogger(__name__)


class DemoError(RollstreamError):
    """The demo could not run to its end (a producer died, no step for too long, a check failed)."""


class LocalBroker:
    """A single-node local Kafka for the demo, in `data_dir`, on a free port.

    Entering blocks until it serves (seconds; the first run resolves the Kafka jars with Maven, minutes).
    A broker that already runs for `data_dir` (kept by an earlier ``--keep-broker`` run) is reused and
    left running. Exiting stops the broker this object started and removes `data_dir`, unless `keep`.

    Raises:
        BrokerError: the broker cannot be started (see `rollstream.infra.broker.start_broker`).
    """

    def __init__(self, data_dir: Path, *, keep: bool = False, tls: bool = False) -> None:
        self.data_dir = Path(data_dir)
        self.keep = keep
        self.tls = tls  # every listener TLS; clients then need `client_config`
        self.bootstrap: str | None = None
        self.started = False

    def __enter__(self) -> LocalBroker:
        status = broker_status(self.data_dir)
        if status.running and status.tls != self.tls:  # kept by a run with(out) --tls: not this run's broker
            stop_broker(self.data_dir, timeout=30.0)
        elif status.running and status.bootstrap:
            self.bootstrap = status.bootstrap
            log.info("reusing the broker already running for %s on %s", self.data_dir, self.bootstrap)
            return self
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)  # a stopped broker's old data: start from scratch
        self.started = True  # set first: a start that fails half-way is still cleaned up
        try:
            self.bootstrap = start_broker(BrokerSpec(port=free_port(), data_dir=self.data_dir, heap_mb=512,
                                                     tls=self.tls), timeout=180.0)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def client_config(self) -> Path | None:
        """The ``--kafka-config`` file that trusts this broker's CA (``tls``), else None."""
        return client_config_files(self.data_dir).get("admin") if self.tls else None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.started or self.keep:
            return
        self.started = False
        stop_broker(self.data_dir, timeout=30.0)
        shutil.rmtree(self.data_dir, ignore_errors=True)


@dataclass(frozen=True)
class ProducerSpec:
    """One producer process: its id, the command line after ``python -m rollstream``, and its log file."""

    producer_id: str
    args: tuple[str, ...]
    log_path: Path


@dataclass(frozen=True)
class ProducerExit:
    """How a producer process ended: its pid, exit code, and whether the demo asked it to stop first."""

    producer_id: str
    pid: int
    returncode: int | None
    stopped_by_demo: bool
    log_path: Path

    @property
    def ok(self) -> bool:
        return self.stopped_by_demo and self.returncode == 0


class ProducerFleet:
    """Runs `specs` as ``python -m rollstream ...`` subprocesses in sessions of their own.

    Own sessions: a Ctrl-C in the terminal reaches only the demo, which then stops them in order.
    Each process writes stdout and stderr to its log file. Not thread-safe.

    Args:
        specs: the producers to start.
        bootstrap: the broker every producer reaches (``ROLLSTREAM_BOOTSTRAP_SERVERS`` in its environment).
        stop_timeout: seconds a producer may drain after SIGTERM before it is killed.
    """

    def __init__(self, specs: Sequence[ProducerSpec], bootstrap: str, *, stop_timeout: float = 20.0) -> None:
        self.specs = tuple(specs)
        self._env = _producer_env(bootstrap)
        self._stop_timeout_s = stop_timeout
        self._procs: list[tuple[ProducerSpec, subprocess.Popen[bytes]]] = []
        self._reported: set[int] = set()
        self.exits: list[ProducerExit] = []

    def __enter__(self) -> ProducerFleet:
        try:
            for spec in self.specs:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                with spec.log_path.open("wb") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "rollstream", *spec.args], stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, env=self._env,
                                            start_new_session=True)
                self._procs.append((spec, proc))
                log.info("started producer %s (pid %d), log %s", spec.producer_id, proc.pid, spec.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pids(self) -> list[int]:
        return [proc.pid for _, proc in self._procs]

    def newly_exited(self) -> list[ProducerExit]:
        """Producers that exited on their own since the last call (they should run until `stop`)."""
        found = []
        for spec, proc in self._procs:
            if proc.pid not in self._reported and proc.poll() is not None:
                self._reported.add(proc.pid)
                found.append(ProducerExit(spec.producer_id, proc.pid, proc.returncode, False, spec.log_path))
        return found

    def check(self) -> None:
        """Raise `DemoError` when every producer has exited: nothing will come any more.

        One dead producer is not fatal: the others take its prompt partitions over (and the demo
        reports it at the end).
        """
        if self._procs and all(proc.poll() is not None for _, proc in self._procs):
            spec, proc = self._procs[0]
            raise DemoError(f"every producer exited (e.g. {spec.producer_id}, pid {proc.pid}, code {proc.returncode}); "
                            f"see {spec.log_path}:\n{_tail(spec.log_path)}")

    def stop(self) -> list[ProducerExit]:
        """SIGTERM every running producer, wait up to the stop timeout, SIGKILL the rest. Idempotent.

        Blocks until every process has ended. Returns (and keeps in `exits`) how each one ended.
        """
        procs, self._procs = self._procs, []
        asked: dict[int, bool] = {}
        for _, proc in procs:
            asked[proc.pid] = proc.poll() is None
            if asked[proc.pid]:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self._stop_timeout_s
        for spec, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("producer %s (pid %d) did not stop within %.0f s: killing it", spec.producer_id,
                            proc.pid, self._stop_timeout_s)
                proc.kill()
                proc.wait()
            self.exits.append(ProducerExit(spec.producer_id, proc.pid, proc.returncode, asked[proc.pid],
                                           spec.log_path))
        return list(self.exits)


def _producer_env(bootstrap: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        BOOTSTRAP_ENV: bootstrap,
        # One torch thread per producer: the trainer and the other producers share the same cores.
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONUNBUFFERED": "1",
    })
    return env


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
