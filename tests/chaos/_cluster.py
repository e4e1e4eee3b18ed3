"""The local broker of a chaos run: start and stop it with `rollstream.infra.broker`, pause a node, kill and
restart a node.

Pausing is SIGSTOP/SIGCONT of a node's JVM. Killing is SIGKILL of one node's JVM (as
tests/integration/test_broker_failover.py does). `rollstream.infra.broker` has no public "restart one node": its
`start_broker` restarts *every* node when one is missing, which is a different fault. So `restart_node`
spawns just that node again on its own ``server.properties`` with the private helpers `start_broker`
itself uses, and re-records the pids, so `stop_broker` still stops everything at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from rollstream.infra._broker_files import read_record, write_record
from rollstream.infra._broker_jars import find_java
from rollstream.infra._broker_procs import is_ours, spawn
from rollstream.infra.broker import BrokerError, BrokerSpec, broker_status, ensure_kafka_jars, start_broker, stop_broker


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

    def _recorded(self) -> list[tuple[int, Path]]:
        found = read_record(self.spec.data_dir)
        if found is None:
            raise BrokerError(f"no broker is recorded in {self.spec.data_dir}; was it stopped?")
        return found[1]

    def pid(self, node: int) -> int:
        return self._recorded()[node - 1][0]

    def pause(self, node: int) -> None:
        os.kill(self.pid(node), signal.SIGSTOP)
        self.paused.add(node)

    def resume(self, node: int) -> None:
        try:
            os.kill(self.pid(node), signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.paused.discard(node)

    def kill(self, node: int) -> None:
        pid, config = self._recorded()[node - 1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while is_ours(pid, config) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.down.add(node)
        self.paused.discard(node)

    def restart_node(self, node: int, timeout_s: float = 60.0) -> float:
        """Start node `node` again on its own data; returns the seconds until its client port accepts.

        Raises:
            BrokerError: the JVM could not be spawned or did not listen within `timeout_s`.
        """
        recorded = self._recorded()
        _, config = recorded[node - 1]
        started = time.monotonic()
        pid = spawn(find_java(), ensure_kafka_jars(), self.spec.heap_mb, config)
        recorded[node - 1] = (pid, config)
        write_record(self.spec, recorded)
        port = self.spec.client_ports[node - 1]
        while not _listening(self.spec.host, port):
            if not is_ours(pid, config):
                raise BrokerError(f"Kafka node {node} exited right after its restart; see {config.parent}/kafka.log")
            if time.monotonic() - started > timeout_s:
                raise BrokerError(f"Kafka node {node} did not listen on port {port} within {timeout_s:.0f} s")
            time.sleep(0.2)
        self.down.discard(node)
        return time.monotonic() - started

    def running(self) -> bool:
        return broker_status(self.spec.data_dir).running


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
