"""The stage runtime's life-cycle half: start-up and drain, one way for every stage.

Start-up: tracing, the gRPC server (health, reflection, load), the metrics endpoint,
SERVING, then the registry, so that no peer is sent here before this stage answers. A
warm spare (--standby) holds SERVING back until SIGUSR1.
Drain, on SIGINT or SIGTERM or when a task of the stage fails: NOT_SERVING, out of the
registry, new requests refused (UNAVAILABLE), and those in flight get the grace period to
finish before the servers stop; a stage whose task failed then exits with an error (StageFailed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.registry import Collector

from prism import telemetry, tracing
from prism.registry import Instance, advertise_host, instance, open_registry
from prism.rpc.server import Server, start_server
from prism.runtime.service import Service

if TYPE_CHECKING:
    from prism.config.common import AddressConfig, MetricsConfig, ModelConfig
    from prism.config.registry import ConnectConfig, RegistryConfig

log = logging.getLogger(__name__)

# A stage's background work while it serves: it gets the server (to report health). One
# that raises means the stage cannot serve: it drains and exits (StageFailed), and its
# supervisor starts it again.
Task = Callable[[Server], Coroutine[Any, Any, None]]


def freeze_startup_heap() -> None:
    """Moves every object made so far (modules, tokenizers, engine clients) out of the
    garbage collector's reach, as vLLM's own server does once started: they live as long
    as the process, and full collections that walk them stall the event loop for tens of
    milliseconds mid-stream."""
    gc.collect()
    gc.freeze()


class Door(Protocol):
    """A way into the stage besides its gRPC server (a front's OpenAI REST API): it
    serves from the stage's start until the stage drains."""

    async def serve(self, server: Server) -> None:
        """Serves until `close` and its requests are done; raises if it cannot serve."""

    def close(self) -> None:
        """Takes no new requests; those in flight get the stage's grace period."""


@dataclass
class Replica:
    """One gRPC server of a stage: its services, the count of requests it has in flight
    (for LoadService), and its background tasks."""

    services: Sequence[Service]
    in_flight: Callable[[], int] | None = None
    tasks: Iterable[Task] = ()

    @property
    def names(self) -> list[str]:
        return [service.name for service in self.services]


class StageFailed(Exception):
    """A stage stopped serving because it could not go on (its engine died)."""


class StageSettings(Protocol):
    """What a gRPC stage's config (prism.config.commands) says of where and how it serves."""

    address: AddressConfig
    metrics: MetricsConfig
    model: ModelConfig
    registry: RegistryConfig
    connect: ConnectConfig


class Stage:
    """One stage process: `role` names it in traces and in the registry; `peers` are the
    static registry's entries, for the stages that call others."""

    def __init__(self, config: StageSettings, role: str, peers: Sequence[str] = ()) -> None:
        tracing.setup(role)
        self.config = config
        self.role = role
        self.registry = open_registry(config.registry, peers, config.connect)

    async def serve(
        self,
        services: Sequence[Service],
        modes: Iterable[str],
        collectors: Iterable[Collector] = (),
        in_flight: Callable[[], int] | None = None,
        tasks: Iterable[Task] = (),
        serving: bool = True,
        doors: Sequence[Door] = (),
    ) -> None:
        """Serves `services` (and `doors`) until SIGINT or SIGTERM, then drains. Health
        starts SERVING unless `serving` is False (a task then reports it); `in_flight`
        adds LoadService."""
        await self.serve_replicas(
            [Replica(services, in_flight, tasks)], modes, collectors, serving, doors
        )

    async def serve_replicas(
        self,
        replicas: Sequence[Replica],
        modes: Iterable[str],
        collectors: Iterable[Collector] = (),
        serving: bool = True,
        doors: Sequence[Door] = (),
    ) -> None:
        """Serves each of `replicas` on its own gRPC server, registered apart: the i-th at
        --port + i, or each at a free port where --port is 0. The process's metrics, its
        plaintext health port (the first server's health) and its doors are one."""
        address, metrics = self.config.address, self.config.metrics
        host = address.host
        health = f"{host}:{metrics.health_port}" if metrics.health_port else ""
        servers = []
        for i, replica in enumerate(replicas):
            port = address.port + i if address.port else 0
            servers.append(await start_server(
                f"{host}:{port}", functools.partial(self._register, replica.services),
                replica.names, replica.in_flight, health_address="" if i else health,
                reuse_port=address.reuse_port,
            ))  # fmt: skip
        registries = [self.registry] + [
            open_registry(self.config.registry, (), self.config.connect) for _ in replicas[1:]
        ]
        telemetry.serve_metrics(metrics.metrics_port, host, collectors)
        if address.standby:
            _await_promotion(self.role, servers)
        if serving:
            for server, replica in zip(servers, replicas, strict=True):
                await server.set_serving(replica.names)
        running = [
            asyncio.create_task(task(server))
            for server, replica in zip(servers, replicas, strict=True)
            for task in replica.tasks
        ]
        opened = [asyncio.create_task(door.serve(servers[0])) for door in doors]
        ports = ", ".join(str(server.port) for server in servers)
        log.info("%s serving %s on %s:%s", self.role, self.config.model.model, host, ports)
        try:
            for registry, server in zip(registries, servers, strict=True):
                await registry.register(self._instance(server.port, modes))
            freeze_startup_heap()
            failure = await _terminated_or_failed([*running, *opened])
            if failure is not None:
                log.error("%s cannot serve (%s): draining, then exiting", self.role, failure)
            for server, replica in zip(servers, replicas, strict=True):
                server.draining = True
                await server.set_serving(replica.names, serving=False)
                for service in replica.services:
                    service.drain()
            for door in doors:
                door.close()
            for registry in registries:
                await registry.deregister()
            grace = await _let_requests_finish(replicas, address.shutdown_grace_s)
            # The doors' requests call the services in this process: the stage ends
            # once they are done too.
            stopping = [asyncio.create_task(server.stop(grace)) for server in servers]
            await asyncio.wait([*stopping, *opened])
            await asyncio.gather(*stopping)
            if failure is not None:
                raise StageFailed(f"{self.role}: {failure}") from failure
        finally:
            for task in [*running, *opened]:
                task.cancel()
            for registry in registries:
                await registry.close()

    def _register(self, services: Sequence[Service], server: Any) -> None:
        for service in services:
            service.stage = self.role
            service.add_to_server(server)

    def _instance(self, port: int, modes: Iterable[str]) -> Instance:
        """This stage as the registry lists it, serving at `port`."""
        model, host = self.config.model, self.config.address.host
        return instance(
            self.role,
            advertise_host(self.config.registry, host),
            port,
            model=model.served_model_name or model.model,
            modes=modes,
            health_port=self.config.metrics.health_port,
        )


async def _let_requests_finish(replicas: Sequence[Replica], grace: float) -> float:
    """Waits up to `grace` seconds for the requests the draining services admitted,
    before gRPC's shutdown, which cancels whatever reaches it; the grace left."""
    started = time.monotonic()
    idle = [service.idle() for replica in replicas for service in replica.services]
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*idle), grace)
    return max(0.0, grace - (time.monotonic() - started))


def _await_promotion(role: str, servers: Sequence[Server]) -> None:
    """A warm spare: its servers hold SERVING back until SIGUSR1."""

    async def promote() -> None:
        for server in servers:
            await server.promote()
        log.info("%s promoted from standby: serving", role)

    promoting: set[asyncio.Task] = set()  # held, as the loop keeps weak references only

    def on_signal() -> None:
        task = asyncio.ensure_future(promote())
        promoting.add(task)
        task.add_done_callback(promoting.discard)

    for server in servers:
        server.standby = True
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, on_signal)


async def _terminated_or_failed(tasks: list[asyncio.Task]) -> BaseException | None:
    """Waits for SIGINT or SIGTERM (None), or for one of `tasks` to fail (its error)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    pending = {stopped, *tasks}
    try:
        while stopped in pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopped}:
                if not task.cancelled() and task.exception() is not None:
                    return task.exception()
        return None
    finally:
        stopped.cancel()
