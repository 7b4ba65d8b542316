"""Service discovery and registration: which addresses serve a role.

`--registry static` (the single-machine default): the launcher knows every address and
hands them over as `--peer ROLE=ADDRESS` pairs. `--registry consul://HOST:PORT`: every
service registers itself with a Consul agent and discovers its peers there
(`prism.registry.consul`). `--registry kubernetes:///PREFIX`: peers are the ready pods of
each stage's headless Service (`prism.registry.kubernetes`). All implement `Registry`.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit


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


def add_arguments(parser: argparse.ArgumentParser, peers: str = "", sidecar: bool = True) -> None:
    """The registry flags every service takes; `peers` is an example of `--peer`, for the
    services that call others; `sidecar` adds the Consul Connect flags."""
    parser.add_argument(
        "--registry",
        default="static",
        help="static (peers from --peer), consul://HOST:PORT (register and discover there), "
        "or kubernetes:///PREFIX (the ready pods of the Services PREFIX-ROLE; "
        "kubernetes+http://HOST:PORT/PREFIX through kubectl proxy)",
    )
    if peers:
        parser.add_argument(
            "--peer",
            action="append",
            default=[],
            metavar="ROLE=HOST:PORT",
            help=f"static registry entry, repeatable (e.g. {peers})",
        )
    parser.add_argument(
        "--advertise-host",
        default="",
        help="host that peers dial (default: --host, or this machine's address if that is "
        "a wildcard)",
    )
    consul = parser.add_argument_group("consul registry")
    consul.add_argument(
        "--consul-token",
        default="",
        help="Consul ACL token (default: the CONSUL_HTTP_TOKEN environment variable)",
    )
    consul.add_argument("--consul-check-interval", default="5s", help="health check interval")
    consul.add_argument("--consul-check-timeout", default="2s", help="health check timeout")
    consul.add_argument(
        "--consul-deregister-after",
        default="1m",
        help="Consul removes an instance whose check stayed critical this long",
    )
    if not sidecar:
        return
    consul.add_argument(
        "--consul-connect",
        action="store_true",
        help="also register a Consul Connect sidecar (Envoy) for this service",
    )
    consul.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="ROLE=PORT",
        help="with --consul-connect: call ROLE through the sidecar's local upstream listener "
        "on 127.0.0.1:PORT instead of the addresses Consul lists (repeatable)",
    )


def advertise_host(args: argparse.Namespace) -> str:
    """The host peers reach this service at: a wildcard bind address is not one."""
    if args.advertise_host:
        return args.advertise_host
    try:
        wildcard = ipaddress.ip_address(args.host).is_unspecified
    except ValueError:
        return args.host  # a host name
    return socket.gethostbyname(socket.gethostname()) if wildcard else args.host


def instance(
    args: argparse.Namespace, role: str, port: int, modes: Iterable[str] = (), health: str = "grpc"
) -> Instance:
    """This service as its peers see it, from its command-line arguments."""
    host = advertise_host(args)
    model = getattr(args, "served_model_name", "") or getattr(args, "model", "")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return Instance(role, address, model, tuple(modes), health, getattr(args, "health_port", 0))


def open_registry(args: argparse.Namespace) -> Registry:
    """The registry `--registry` names."""
    if args.registry == "static":
        return StaticRegistry.from_pairs(getattr(args, "peer", []))
    url = urlsplit(args.registry)
    if url.scheme in ("kubernetes", "kubernetes+http"):
        from prism.registry.kubernetes import KubernetesRegistry

        return KubernetesRegistry.from_url(url)
    if url.scheme != "consul" or not url.hostname:
        raise ValueError(
            "--registry must be static, consul://HOST:PORT, kubernetes:///PREFIX or "
            f"kubernetes+http://HOST:PORT/PREFIX, got {args.registry!r}"
        )
    from prism.registry.consul import ConsulRegistry

    upstreams = {}
    for pair in getattr(args, "upstream", []):
        role, sep, port = pair.partition("=")
        if not sep or not port.isdigit():
            raise ValueError(f"upstream must be ROLE=PORT, got {pair!r}")
        upstreams[role] = int(port)
    return ConsulRegistry(
        url.hostname,
        url.port or 8500,
        token=args.consul_token or None,
        check_interval=args.consul_check_interval,
        check_timeout=args.consul_check_timeout,
        deregister_after=args.consul_deregister_after,
        connect=getattr(args, "consul_connect", False),
        upstreams=upstreams,
    )
