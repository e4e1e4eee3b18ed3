"""A broker's ports are free and below the OS's ephemeral range (rollstream.infra.broker.free_port): a node killed and
restarted must find its port unclaimed by the outgoing connections its own clients make to it meanwhile."""

from __future__ import annotations

import socket
from pathlib import Path

from rollstream.infra.broker import free_port, free_ports
from rollstream.infra.broker._spec import CONTROLLER_PORT_OFFSET


def _first_ephemeral() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    base = free_port(3)
    ports = [base + i for i in range(3)] + [base + CONTROLLER_PORT_OFFSET + i for i in range(3)]
    assert all(_bindable(p) for p in ports) and max(ports) < _first_ephemeral()
    port, controller = free_ports(3)
    assert max(port, controller) + 2 < _first_ephemeral() and {port, port + 1, port + 2}.isdisjoint(
        {controller, controller + 1, controller + 2})
