"""The Consul registry backend, on py-consul's asyncio client.

Each service registers with the local Consul agent under `prism-ROLE`, with a unique id,
its role, model and modes as tags and meta, and a health check that Consul runs against
the service's own `grpc.health.v1` (the gateway: `GET /health`). Discovery lists only
instances whose checks pass and follows changes with blocking queries.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

from consul import Check
from consul.aio import Consul

from prism.registry import Instance
from prism.rpc.tls import tls_enabled

log = logging.getLogger(__name__)

# How long one blocking query waits for a change before Consul answers anyway.
_WAIT = "30s"


def service_name(role: str) -> str:
    return f"prism-{role}"


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _address(entry: dict[str, Any]) -> str:
    """HOST:PORT of one entry of /v1/health/service (the node's address if the service
    registered none, as Consul's own DNS interface does)."""
    service = entry["Service"]
    host = service.get("Address") or entry["Node"]["Address"]
    return f"[{host}]:{service['Port']}" if ":" in host else f"{host}:{service['Port']}"


class ConsulRegistry:
    def __init__(
        self,
        host: str,
        port: int = 8500,
        *,
        token: str | None = None,
        check_interval: str = "5s",
        check_timeout: str = "2s",
        deregister_after: str = "1m",
        connect: bool = False,
        upstreams: dict[str, int] | None = None,
        wait: str = _WAIT,
        id_suffix: str = "",
    ):
        self.host, self.port = host, port
        self.token = token
        self.check_interval = check_interval
        self.check_timeout = check_timeout
        self.deregister_after = deregister_after
        self.connect = connect
        self.upstreams = dict(upstreams or {})
        self.wait = wait
        self.id_suffix = id_suffix
        self._consul: Consul | None = None
        self._endpoints: dict[str, list[str]] = {}
        self._watches: dict[str, asyncio.Task] = {}
        self._registered: list[str] = []

    @property
    def _client(self) -> Consul:
        # Made on first use: its aiohttp session needs the running event loop.
        if self._consul is None:
            self._consul = Consul(host=self.host, port=self.port, token=self.token)
        return self._consul

    def endpoints(self, role: str) -> list[str]:
        if role in self.upstreams:
            # The Connect sidecar's local listener stands in for every instance of the role.
            return [f"127.0.0.1:{self.upstreams[role]}"]
        return list(self._endpoints.get(role, ()))

    async def watch(self, role: str, tags: Sequence[str] = ()) -> None:
        if role not in self.upstreams and role not in self._watches:
            self._watches[role] = asyncio.create_task(self._follow(role, list(tags)))

    async def _follow(self, role: str, tags: list[str]) -> None:
        index = 0
        pause = 0.5
        while True:
            try:
                new_index, entries = await self._client.health.service(
                    service_name(role),
                    index=index or None,
                    wait=self.wait,
                    passing=True,
                    tag=tags or None,
                    token=self.token,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the agent is down or restarting: try again later
                log.warning("consul: cannot list %s: %s", service_name(role), exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 10.0)
                continue
            pause = 0.5
            addresses = [_address(entry) for entry in entries]
            if addresses != self._endpoints.get(role):
                log.info("consul: %s now %s", role, addresses or "none")
            self._endpoints[role] = addresses
            # Consul's rules for blocking queries: start over when the index goes
            # backwards, and never block on an index below 1.
            new = int(new_index or 0)
            index = 0 if new < index else max(new, 1)

    def _check(self, instance: Instance) -> dict[str, Any]:
        timing = {
            "interval": self.check_interval,
            "timeout": self.check_timeout,
            "deregister": self.deregister_after,
        }
        if instance.health == "http":
            return Check.http(f"http://{instance.address}/health", **timing)
        if instance.health_port:
            host = instance.address.rpartition(":")[0]  # brackets kept around IPv6
            return Check.grpc(f"{host}:{instance.health_port}", **timing)
        # Consul's agent dials the check itself: with TLS it needs the CA (and, for mutual
        # TLS, a client certificate) in its own configuration.
        return Check.grpc(instance.address, use_tls=tls_enabled() or None, **timing)

    async def register(self, instance: Instance) -> None:
        host, port = _split(instance.address)
        name = service_name(instance.role)
        suffix = f"-{self.id_suffix}" if self.id_suffix else ""
        service_id = re.sub(r"[^A-Za-z0-9-]+", "-", f"{name}-{host}-{port}{suffix}")
        connect = None
        if self.connect:
            upstreams = [
                {"DestinationName": service_name(role), "LocalBindPort": local_port}
                for role, local_port in sorted(self.upstreams.items())
            ]
            connect = {"SidecarService": {"Proxy": {"Upstreams": upstreams}}}
        await self._client.agent.service.register(
            name,
            service_id=service_id,
            address=host,
            port=port,
            tags=[
                f"role={instance.role}",
                *([f"model={instance.model}"] if instance.model else []),
                *(f"mode={mode}" for mode in instance.modes),
            ],
            meta={
                "role": instance.role,
                "model": instance.model,
                "modes": ",".join(instance.modes),
                "address": instance.address,
            },
            check=self._check(instance),
            connect=connect,
            token=self.token,
        )
        self._registered.append(service_id)
        log.info("consul: registered %s at %s", service_id, instance.address)

    async def deregister(self) -> None:
        while self._registered:
            service_id = self._registered.pop()
            try:
                await self._client.agent.service.deregister(service_id, token=self.token)
            except Exception as exc:  # Consul deregisters it anyway once its check fails
                log.warning("consul: cannot deregister %s: %s", service_id, exc)

    async def close(self) -> None:
        await self.deregister()
        for task in self._watches.values():
            task.cancel()
        await asyncio.gather(*self._watches.values(), return_exceptions=True)
        self._watches.clear()
        if self._consul is not None:
            await self._consul.close()
            self._consul = None
