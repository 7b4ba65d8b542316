"""Ports for stages that bind them later: free now, outside the kernel's ephemeral range,
and handed out once per process."""

from __future__ import annotations

import random
import socket


def _ephemeral_ports() -> range:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


# Ports this process has handed out: a port is bound later, by another process, and must
# not be handed out twice meanwhile.
_issued: set[int] = set()


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port free now, outside the kernel's ephemeral range, not handed out before; with
    `count`, the first of that many such ports in a row (a process of several servers at
    --port + i).

    The port is bound later, by a stage that may take a minute to start; meanwhile the
    engines open many outgoing and listening sockets on kernel-chosen ephemeral ports,
    one of which could otherwise take it.
    """
    ephemeral = _ephemeral_ports()
    for _ in range(1000):
        first = random.randrange(10000, 65536 - count + 1)
        ports = range(first, first + count)
        if any(port in ephemeral or port in _issued for port in ports):
            continue
        if all(_bindable(host, port) for port in ports):
            _issued.update(ports)
            return first
    raise OSError("no free port")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
