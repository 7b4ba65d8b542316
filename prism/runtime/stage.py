"""The stage runtime's life-cycle half: start-up and drain, one way for every stage.

Start-up: tracing, the gRPC server (health, reflection, load), the metrics endpoint,
SERVING, then the registry, so that no peer is sent here before this stage answers.
Drain, on SIGINT or SIGTERM or when a task of the stage fails: NOT_SERVING, out of the
registry, batched streams take no new calls, and calls in flight get the grace period to
finish; a stage whose task failed then exits with an error (StageFailed).
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

from prism import telemetry, tracing
from prism.registry import instance, open_registry
from prism.rpc.server import Server, start_server
from prism.runtime.service import Service

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


class StageFailed(Exception):
    """A stage stopped serving because it could not go on (its engine died)."""


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
                service.stage = self.role
                service.add_to_server(server)

        health = f"{args.host}:{args.health_port}" if args.health_port else ""
        server = await start_server(
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
            failure = await _terminated_or_failed(running)
            if failure is not None:
                log.error("%s cannot serve (%s): draining, then exiting", self.role, failure)
            server.draining = True
            await server.set_serving(names, serving=False)
            for service in services:
                service.drain()
            await self.registry.deregister()
            await server.stop(args.shutdown_grace_s)
            if failure is not None:
                raise StageFailed(f"{self.role}: {failure}") from failure
        finally:
            for task in running:
                task.cancel()
            await self.registry.close()


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
