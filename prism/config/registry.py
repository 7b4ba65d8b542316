"""The registry's flags, which every stage and `prism serve` take (prism.config.commands
lists which command takes which). Only prism.config.flags is imported, which imports only
the standard library: the front loads nothing more for them."""

from __future__ import annotations

import os
from dataclasses import dataclass

from prism.config.flags import Flags, flag

STATIC = "static"
_CONSUL = "consul registry"


@dataclass
class RegistryConfig(Flags):
    registry: str = flag(
        STATIC,
        "static (peers from --peer), consul://HOST:PORT (register and discover there), "
        "or kubernetes:///PREFIX (the ready pods of the Services PREFIX-ROLE; "
        "kubernetes+http://HOST:PORT/PREFIX through kubectl proxy)",
    )
    advertise_host: str = flag(
        "",
        "host that peers dial (default: --host, or this machine's address if that is a wildcard)",
    )
    consul_token: str = flag(
        help="Consul ACL token (default: CONSUL_HTTP_TOKEN; the stages prism serve starts "
        "get it there, never on their command line)",
        factory=lambda: os.environ.get("CONSUL_HTTP_TOKEN", ""),
        secret=True,
        group=_CONSUL,
    )
    consul_check_interval: str = flag("5s", "health check interval", group=_CONSUL)
    consul_check_timeout: str = flag("2s", "health check timeout", group=_CONSUL)
    consul_deregister_after: str = flag(
        "1m", "Consul removes an instance whose check stayed critical this long", group=_CONSUL
    )
    consul_id_suffix: str = flag(
        "",
        "added to this instance's service ID, where processes share an address (the fronts "
        "of prism serve --front-workers)",
        group=_CONSUL,
    )

    def to_argv(self) -> list[str]:
        # The static registry's entries come as --peer: its own flags would say nothing.
        return [] if self.registry == STATIC else super().to_argv()


@dataclass
class PeersConfig(Flags):
    """The static registry's entries, for the stages that call others."""

    peer: list[str] = flag(
        help="static registry entry, repeatable (e.g. worker=127.0.0.1:50051)",
        factory=list,
        metavar="ROLE=HOST:PORT",
    )


@dataclass
class ConnectConfig(Flags):
    """A Consul Connect sidecar (Envoy) beside a stage, and the upstreams it calls through."""

    group = _CONSUL

    consul_connect: bool = flag(
        False, "also register a Consul Connect sidecar (Envoy) for this service"
    )
    upstream: list[str] = flag(
        help="with --consul-connect: call ROLE through the sidecar's local upstream listener "
        "on 127.0.0.1:PORT instead of the addresses Consul lists (repeatable)",
        factory=list,
        metavar="ROLE=PORT",
    )
