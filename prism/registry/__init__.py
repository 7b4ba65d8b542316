"""Service discovery: which addresses serve a role.

`StaticRegistry` is the single-machine default: the launcher knows every address and
hands them over as `ROLE=ADDRESS` pairs. Other backends implement the same protocol.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Protocol

import grpc

from prism.rpc import PrismError


class Registry(Protocol):
    def endpoints(self, role: str) -> list[str]:
        """Addresses of the live instances serving `role`."""
        ...


class StaticRegistry:
    def __init__(self, peers: dict[str, list[str]]):
        self._peers = {role: list(addrs) for role, addrs in peers.items()}

    @classmethod
    def from_pairs(cls, pairs: Iterable[str]) -> StaticRegistry:
        peers: dict[str, list[str]] = {}
        for pair in pairs:
            role, sep, address = pair.partition("=")
            if not sep or not role or not address:
                raise ValueError(f"peer must be ROLE=HOST:PORT, got {pair!r}")
            peers.setdefault(role, []).append(address)
        return cls(peers)

    def endpoints(self, role: str) -> list[str]:
        return list(self._peers.get(role, ()))


class RoundRobin:
    """Picks the next address of a role in turn."""

    def __init__(self, registry: Registry):
        self.registry = registry
        self._counter = itertools.count()

    def pick(self, role: str) -> str:
        addresses = self.registry.endpoints(role)
        if not addresses:
            raise PrismError(grpc.StatusCode.UNAVAILABLE, f"no {role} is available")
        return addresses[next(self._counter) % len(addresses)]
