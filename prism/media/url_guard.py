"""Which addresses a media URL may reach: public ones only, unless the operator allows more.

Requests name image and video URLs, so a fetch must not become a way into the network
behind Prism (loopback, private ranges, link-local, cloud metadata services). Every address a URL's
host resolves to is checked, at connect time, on the first request and on every redirect:
the check runs inside the HTTP client's resolver, so the address checked is the address
connected to (no window for DNS rebinding). IP literals never reach a resolver; `check_host`
covers them.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

from aiohttp.abc import AbstractResolver
from aiohttp.resolver import DefaultResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud metadata services, named apart for clearer errors (most also fall in the ranges below).
_METADATA = {
    ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack, ...
    ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
    ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
}


class Refused(Exception):
    """A URL's host is, or resolves to, an address outside what fetches may reach."""


def blocked_reason(address: Address) -> str | None:
    """Why a fetch may not connect to `address`, or None if it is a public address."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in _METADATA:
        return "cloud metadata"
    for reason, flag in (
        ("loopback", address.is_loopback),
        ("unspecified", address.is_unspecified),
        ("link-local", address.is_link_local),
        ("private", address.is_private),
        ("multicast", address.is_multicast),
    ):
        if flag:
            return reason
    return None if address.is_global else "non-public"


class Allowance:
    """The operator's exceptions: host names (whatever they resolve to) and networks."""

    def __init__(self, entries: Iterable[str] = ()):
        self.names: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.lower().rstrip("."))

    def admits_name(self, host: str) -> bool:
        return host.lower().rstrip(".") in self.names

    def check(self, host: str, address: Address) -> None:
        """Raises Refused unless `address` (of `host`) may be fetched from."""
        reason = blocked_reason(address)
        if reason and not any(address in network for network in self.networks):
            raise Refused(f"{host} is a {reason} address ({address})")


def check_host(host: str, allowance: Allowance) -> None:
    """Checks a URL's host if it is an IP literal (names are checked when resolved)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return
    if not allowance.admits_name(host):
        allowance.check(host, address)


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that refuses hosts resolving to an address the allowance bars."""

    def __init__(self, allowance: Allowance, resolver: AbstractResolver | None = None):
        self.allowance = allowance
        self._resolver = resolver or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[dict[str, Any]]:
        results = await self._resolver.resolve(host, port, family)
        if not self.allowance.admits_name(host):
            # One barred address bars the name: a client may connect to any of them.
            for result in results:
                self.allowance.check(host, ipaddress.ip_address(result["host"]))
        return results

    async def close(self) -> None:
        await self._resolver.close()
