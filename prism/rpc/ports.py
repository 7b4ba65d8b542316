"""A port a server is about to listen on, refused with one line (`PortInUse`) when another
process listens there. gRPC sets SO_REUSEPORT by default, and so do the fronts that share
their ports: a second server would bind the same port without a word and take a share of
the first one's connections."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import tempfile
from pathlib import Path


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


def claim(door: str, host: str, port: int) -> int | None:
    """Checks `host`:`port` as ensure_free does and locks it among the Prism processes of
    this machine, for the life of this one (the lock's descriptor, returned, is not
    inherited across exec): a second mesh that checks the same address after this one's
    check and before its fronts bind it finds it claimed (PortInUse). None where `port` is 0.
    """
    ensure_free(door, host, port)
    if not port:
        return None
    # Every user's meshes meet here: the directory is shared as /tmp is (sticky).
    directory = Path(tempfile.gettempdir()) / "prism-ports"
    if not directory.exists():
        directory.mkdir(exist_ok=True)
        directory.chmod(0o1777)
    path = directory / f"{host or 'any'}-{port}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except PermissionError:  # another user's lock file: flock takes a read-only descriptor
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise PortInUse(door, host, port) from None
    return fd
