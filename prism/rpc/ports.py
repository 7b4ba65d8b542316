"""A port a server is about to listen on, refused with one line (`PortInUse`) when another
process listens there. gRPC sets SO_REUSEPORT by default, and so do the fronts that share
their ports: a second server would bind the same port without a word and take a share of
the first one's connections."""

from __future__ import annotations

import errno
import socket


class PortInUse(OSError):
    """Another process listens on a port this one was told to serve."""

    def __init__(self, door: str, host: str, port: int) -> None:
        super().__init__(
            f"{door} port {port} on {host or 'every address'} is in use by another process"
        )


def split(address: str) -> tuple[str, int]:
    """HOST:PORT (the host bracketed when IPv6) as host and port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def ensure_free(door: str, host: str, port: int) -> None:
    """Raises PortInUse if a socket listens at `host`:`port` (any port is free where
    `port` is 0): a bind there without SO_REUSEPORT then fails, whether or not the
    listener set it. A connection in TIME_WAIT does not count, as for the servers."""
    if not port:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(door, host, port) from None
                raise
