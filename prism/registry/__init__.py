"""Service discovery and registration: which addresses serve a role.

`--registry static` (the single-machine default): the launcher knows every address and
hands them over as `--peer ROLE=ADDRESS` pairs. `--registry consul://HOST:PORT`: every
service registers itself with a Consul agent and discovers its peers there
(`prism.registry.consul`). `--registry kubernetes:///PREFIX`: peers are the ready pods of
each stage's headless Service (`prism.registry.kubernetes`). All implement `Registry`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

from prism.config.registry import STATIC, ConnectConfig, RegistryConfig


@dataclass(frozen=True)
class Instance:
    """One running service, as others find it."""

    role: str  # worker, encoder, prefill, decode, processor or gateway
    address: str  # HOST:PORT that peers dial
    model: str = ""  # the served model name
    modes: tuple[str, ...] = ()  # the deployment modes it can take part in
    health: str = "grpc"  # grpc: grpc.health.v1 on `address`; http: GET /health
    # grpc.health.v1 in plaintext on this port of the host too (`--health-port`; 0: none).
    health_port: int = 0


class Registry(Protocol):
    def endpoints(self, role: str) -> list[str]:
        """Addresses of the live instances serving `role`."""
        ...

    async def watch(self, role: str, tags: Sequence[str] = ()) -> None:
        """Starts following the instances of `role` that carry every tag in `tags`."""
        ...

    async def register(self, instance: Instance) -> None: ...

    async def deregister(self) -> None:
        """Withdraws what this process registered (on drain: no new requests come)."""
        ...

    async def close(self) -> None: ...


def discovery_tags(model: str = "", mode: str = "") -> list[str]:
    """The tags that select the instances of one model and mode."""
    return [tag for tag in (model and f"model={model}", mode and f"mode={mode}") if tag]


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

    # The launcher already told everyone where everything is.
    async def watch(self, role: str, tags: Sequence[str] = ()) -> None:
        pass

    async def register(self, instance: Instance) -> None:
        pass

    async def deregister(self) -> None:
        pass

    async def close(self) -> None:
        pass


def advertise_host(config: RegistryConfig, host: str) -> str:
    """The host peers reach a service bound to `host` at: a wildcard is not one."""
    if config.advertise_host:
        return config.advertise_host
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host  # a host name
    return socket.gethostbyname(socket.gethostname()) if wildcard else host


def instance(
    role: str,
    host: str,
    port: int,
    *,
    model: str = "",
    modes: Iterable[str] = (),
    health: str = "grpc",
    health_port: int = 0,
) -> Instance:
    """This service as its peers see it: `role` at `host` (advertise_host's) and `port`."""
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Instance(role, address, model, tuple(modes), health, health_port)


def open_registry(
    config: RegistryConfig, peers: Iterable[str] = (), connect: ConnectConfig | None = None
) -> Registry:
    """The registry `config` names; the static one holds `peers` (ROLE=HOST:PORT), and
    Consul registers `connect`'s sidecar, if asked, and calls through its upstreams."""
    if config.registry == STATIC:
        return StaticRegistry.from_pairs(peers)
    url = urlsplit(config.registry)
    if url.scheme in ("kubernetes", "kubernetes+http"):
        from prism.registry.kubernetes import KubernetesRegistry

        return KubernetesRegistry.from_url(url)
    if url.scheme != "consul" or not url.hostname:
        raise ValueError(
            "--registry must be static, consul://HOST:PORT, kubernetes:///PREFIX or "
            f"kubernetes+http://HOST:PORT/PREFIX, got {config.registry!r}"
        )
    from prism.registry.consul import ConsulRegistry

    connect = connect or ConnectConfig()
    upstreams = {}
    for pair in connect.upstream:
        role, sep, port = pair.partition("=")
        if not sep or not port.isdigit():
            raise ValueError(f"upstream must be ROLE=PORT, got {pair!r}")
        upstreams[role] = int(port)
    return ConsulRegistry(
        url.hostname,
        url.port or 8500,
        token=config.consul_token or None,
        check_interval=config.consul_check_interval,
        check_timeout=config.consul_check_timeout,
        deregister_after=config.consul_deregister_after,
        id_suffix=config.consul_id_suffix,
        connect=connect.consul_connect,
        upstreams=upstreams,
    )
