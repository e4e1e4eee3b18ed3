"""The local broker of a chaos run: start and stop it with `rollstream.infra.broker`, pause a node, kill and
restart a node.

Pausing is SIGSTOP/SIGCONT of a node's JVM. Killing is SIGKILL of one node's JVM (as
tests/integration/test_broker_failover.py does). Restarting is `rollstream.infra.broker.restart_node`: that
node alone, on its own data (`start_broker` would restart *every* node, a different fault); it re-records the
pids, so `stop_broker` still stops everything at the end.
"""

from __future__ import annotations

import os
import signal
import time

from rollstream.infra.broker import BrokerError, BrokerSpec, broker_status, restart_node, start_broker, stop_broker


class Cluster:
    """One local broker (1 or 3 nodes) under a private data dir; nodes are numbered from 1."""

    def __init__(self, spec: BrokerSpec) -> None:
        self.spec = spec
        self.paused: set[int] = set()
        self.down: set[int] = set()

    def start(self, timeout_s: float = 180.0) -> str:
        return start_broker(self.spec, timeout=timeout_s)

    def stop(self) -> None:
        """Continue what is paused and stop every node (SIGTERM, then SIGKILL)."""
        for node in sorted(self.paused):
            self.resume(node)
        stop_broker(self.spec.data_dir, timeout=20.0)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(range(1, self.spec.nodes + 1))

    def pid(self, node: int) -> int:
        """The pid of node `node`'s JVM; BrokerError when it does not run."""
        pids = broker_status(self.spec.data_dir).node_pids
        pid = pids[node - 1] if 1 <= node <= len(pids) else None
        if pid is None:
            raise BrokerError(f"Kafka node {node} of {self.spec.data_dir} does not run (node pids: {pids})")
        return pid

    def pause(self, node: int) -> None:
        os.kill(self.pid(node), signal.SIGSTOP)
        self.paused.add(node)

    def resume(self, node: int) -> None:
        try:
            os.kill(self.pid(node), signal.SIGCONT)
        except (ProcessLookupError, BrokerError):  # it died meanwhile: nothing left to continue
            pass
        self.paused.discard(node)

    def kill(self, node: int) -> None:
        pid = self.pid(node)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _exists(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.down.add(node)
        self.paused.discard(node)

    def restart_node(self, node: int, timeout_s: float = 60.0) -> float:
        """Start node `node` again on its own data; returns the seconds until it serves (`restart_node`).

        Raises:
            BrokerError: the JVM could not be spawned, exited, or did not serve within `timeout_s`.
        """
        took = restart_node(self.spec.data_dir, node, timeout=timeout_s)
        self.down.discard(node)
        return took

    def running(self) -> bool:
        return broker_status(self.spec.data_dir).running


def _exists(pid: int) -> bool:
    """Whether `pid` is still a process (the killed JVM is reaped by init, not by us)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
