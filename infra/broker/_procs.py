"""The local broker's JVMs: format node storage, spawn detached ``kafka.Kafka`` nodes, check and stop them.

A node is "ours" only while its command line names ``kafka.Kafka`` and its own ``server.properties``, so a
recycled pid is never signalled. Every wait here is bounded; on any error path what was started here is
killed before the error propagates.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from rollstream.infra.broker._files import TAIL_LINES
from rollstream.infra.broker._spec import BrokerError

log = logging.getLogger(__name__)

_LOG4J = Path(__file__).resolve().parent.parent / "kafka" / "log4j2.properties"
# Serial GC and C1 only: the JVM serves in ~1.5 s on two cores instead of ~2.5 s with G1 + C2.
_JVM_FLAGS = ("-XX:+UseSerialGC", "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")
# ...except for TLS: C1 does not compile AES-GCM to the CPU's AES and carry-less multiply instructions, C2 does.
# C1 alone made a --tls broker move 10 KB groups ~8x slower than plaintext (raw confluent-kafka, `make bench`'s
# tls part); with C2 TLS costs what it costs on a production broker.
_C1_ONLY = "-XX:TieredStopAtLevel=1"
_SPAWN_TIMEOUT = 30.0  # /bin/sh only forks java and prints its pid
_FIX_JAVA = "check that JAVA_HOME or PATH names a Java 17+ runtime"


def _java_cmd(java: str, libs: Path, heap_mb: int, node_dir: Path, main: str, *args: str,
              crypto: bool = False) -> list[str]:
    jit = () if crypto else (_C1_ONLY,)
    return [java, f"-Xmx{heap_mb}m", *_JVM_FLAGS, *jit, f"-Dlog4j2.configurationFile={_LOG4J}",
            f"-Dkafka.logs.dir={node_dir}", "-cp", f"{libs}/*", main, *args]


def format_storage(java: str, libs: Path, configs: Sequence[Path], cluster: str, deadline: float,
                   extra_args: Sequence[str] = ()) -> None:
    """Format, in parallel, the storage of every node in ``configs`` not formatted yet, as cluster ``cluster``.

    ``extra_args`` go to every ``StorageTool format`` (``--add-scram`` for the SASL mode's users).

    Blocks until each formatter exits, at most until ``deadline`` (``time.monotonic()``; at least 1 s).

    Raises:
        BrokerError: a formatter could not run, failed (with its output) or outlived ``deadline``;
            every formatter still running is killed first.
    """
    todo = [c for c in configs if not (c.parent / "data" / "meta.properties").exists()]
    runs: list[tuple[Path, subprocess.Popen[str]]] = []
    try:
        for config in todo:
            cmd = _java_cmd(java, libs, 256, config.parent, "kafka.tools.StorageTool", "format",
                            f"--cluster-id={cluster}", "-c", str(config), *extra_args)
            try:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
            except OSError as exc:
                raise BrokerError(f"could not run {java} to format {config.parent}: {exc}; {_FIX_JAVA}") from exc
            runs.append((config, proc))
        for config, proc in runs:
            try:
                output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise BrokerError(f"formatting {config.parent} did not finish within the start timeout; "
                                  "start again with a longer timeout", retriable=True) from exc
            if proc.returncode != 0:
                raise BrokerError(f"formatting {config.parent} failed (exit {proc.returncode}); its output below "
                                  "says why; fix that, or start from an empty data dir:\n"
                                  + "\n".join(output.splitlines()[-TAIL_LINES:]))
            log.info("formatted %s for cluster %s", config.parent, cluster)
    finally:
        for _, proc in runs:  # only on an error path is one still running
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def spawn(java: str, libs: Path, heap_mb: int, config: Path, *, tls: bool = False) -> int:
    """Start one detached ``kafka.Kafka`` JVM on ``config`` and return its pid (not our child: no zombie).
    ``tls``: its listeners encrypt, so it gets the JVM's optimizing compiler too (slower start, fast AES-GCM).

    Blocks up to ~35 s (the fork, then until the child has exec'd java). The JVM runs in its own session and
    outlives this process; its stdout and stderr append to ``stdout.log`` next to ``config``.

    Raises:
        BrokerError: ``/bin/sh`` could not start java (nothing is left running).
    """
    node_dir = config.parent
    cmd = _java_cmd(java, libs, heap_mb, node_dir, "kafka.Kafka", str(config), crypto=tls)
    # sh backgrounds java and exits; java is re-parented, so it outlives us and is reaped by init.
    script = 'out=$1; shift; "$@" </dev/null >>"$out" 2>&1 & echo $!'
    try:
        done = subprocess.run(["/bin/sh", "-c", script, "sh", str(node_dir / "stdout.log"), *cmd],
                              capture_output=True, text=True, timeout=_SPAWN_TIMEOUT, start_new_session=True,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrokerError(f"could not launch Kafka node {node_dir.name} through /bin/sh: {exc}") from exc
    if done.returncode != 0 or not done.stdout.strip().isdigit():
        said = done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}"
        raise BrokerError(f"could not launch Kafka node {node_dir.name} with {java}: {said}; {_FIX_JAVA}")
    pid = int(done.stdout.strip())
    try:
        end = time.monotonic() + 5.0
        while not is_ours(pid, config) and time.monotonic() < end:  # the fork has not exec'd java yet
            time.sleep(0.01)
    except BaseException:
        _kill(pid)  # interrupted before the caller could record the pid: nobody else could stop it
        raise
    log.debug("started Kafka node %s as pid %d", node_dir.name, pid)
    return pid


def terminate(procs: Sequence[tuple[int, Path]], timeout: float) -> bool:
    """SIGTERM, wait up to ``timeout`` s, SIGKILL the rest (and wait up to 5 s more).

    Signals only the (pid, config) pairs that are still ours. True if any signal was delivered.
    """
    signalled = False
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        live = [(pid, cfg) for pid, cfg in procs if is_ours(pid, cfg)]
        if not live:
            break
        if sig == signal.SIGKILL:
            log.warning("Kafka pids %s ignored SIGTERM for %.0f s; sending SIGKILL", [p for p, _ in live], timeout)
        for pid, _ in live:
            signalled = _kill(pid, sig) or signalled
        end = time.monotonic() + wait
        while time.monotonic() < end and any(is_ours(pid, cfg) for pid, cfg in live):
            time.sleep(0.1)
    return signalled


def _kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def is_ours(pid: int, config: Path) -> bool:
    """True while ``pid`` is a live ``kafka.Kafka`` JVM started on ``config`` (a zombie is not live)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False  # Linux: no such process
        argv = _ps_argv(pid)  # no /proc at all (macOS)
    except OSError:
        argv = _ps_argv(pid)
    return b"kafka.Kafka" in argv and os.fsencode(str(config)) in argv


def _ps_argv(pid: int) -> list[bytes]:
    """``pid``'s command line as ``ps`` shows it, split at blanks (a zombie shows as "<defunct>")."""
    try:
        done = subprocess.run(["ps", "-o", "command=", "-p", str(pid)], capture_output=True, timeout=5.0,
                              stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []  # unverifiable: treated as not ours, so never signalled
    return done.stdout.split()
