"""The stage runtime's life-cycle half: start-up and drain, one way for every stage.

Start-up: tracing, the gRPC server (health, reflection, load), the metrics endpoint,
SERVING, then the registry, so that no peer is sent here before this stage answers.
Drain, on SIGINT or SIGTERM: NOT_SERVING, out of the registry, batched streams take no
new calls, and calls in flight get the grace period to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from prometheus_client.registry import Collector

from prism import rpc, telemetry, tracing
from prism.registry import instance, open_registry
from prism.runtime.service import Service

log = logging.getLogger(__name__)

# A stage's background work while it serves: it gets the server (to report health).
Task = Callable[[rpc.Server], Coroutine[Any, Any, None]]


def freeze_startup_heap() -> None:
    """Moves every object made so far (modules, tokenizers, engine clients) out of the
    garbage collector's reach, as vLLM's own server does once started: they live as long
    as the process, and full collections that walk them stall the event loop for tens of
    milliseconds mid-stream."""
    gc.collect()
    gc.freeze()


class Stage:
    """One stage process: `role` names it in traces and in the registry."""

    def __init__(self, args: argparse.Namespace, role: str) -> None:
        tracing.setup(role)
        self.args = args
        self.role = role
        self.registry = open_registry(args)

    async def serve(
        self,
        services: Sequence[Service],
        modes: Iterable[str],
        collectors: Iterable[Collector] = (),
        in_flight: Callable[[], int] | None = None,
        tasks: Iterable[Task] = (),
        serving: bool = True,
    ) -> None:
        """Serves `services` until SIGINT or SIGTERM, then drains. Health starts SERVING
        unless `serving` is False (a task then reports it); `in_flight` adds LoadService."""
        args = self.args
        names = [service.name for service in services]

        def register(server: Any) -> None:
            for service in services:
                service.add_to_server(server)

        health = f"{args.host}:{args.health_port}" if args.health_port else ""
        server = await rpc.start_server(
            f"{args.host}:{args.port}", register, names, in_flight, health_address=health
        )
        telemetry.serve_metrics(args.metrics_port, args.host, collectors)
        if serving:
            await server.set_serving(names)
        running = [asyncio.create_task(task(server)) for task in tasks]
        log.info("%s serving %s on %s:%d", self.role, args.model, args.host, server.port)
        try:
            await self.registry.register(instance(args, self.role, server.port, modes))
            freeze_startup_heap()
            await _terminated()
            server.draining = True
            await server.set_serving(names, serving=False)
            for service in services:
                service.drain()
            await self.registry.deregister()
            await server.stop(args.shutdown_grace_s)
        finally:
            for task in running:
                task.cancel()
            await self.registry.close()


async def _terminated() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
