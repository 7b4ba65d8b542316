"""The HTTP front door: OpenAI's REST API over the processor's `InferenceService`,
assembled from one router per endpoint, and KServe v2 gRPC on a port of its own."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

import prism
from prism import tracing
from prism.config.gateway import GatewayConfig
from prism.gateway import health, hot, middleware, openapi
from prism.gateway.anthropic import router as messages
from prism.gateway.batch import router as batches
from prism.gateway.batch.schemas import BatchSettings
from prism.gateway.client import GrpcProcessorClient, ProcessorClient
from prism.gateway.kserve import servicer as kserve
from prism.gateway.openai import chat, completions, lora, models
from prism.gateway.openai.responses import router as responses
from prism.gateway.openai.responses.store import ResponseStore
from prism.registry import Instance, Registry, advertise_host, instance, open_registry
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.rpc.ports import ensure_free
from prism.rpc.server import InFlightLimit
from prism.runtime.stage import freeze_startup_heap

if TYPE_CHECKING:
    from prism.config.commands import GatewayStageConfig
    from prism.config.common import AddressConfig, LimitConfig
    from prism.config.registry import ConnectConfig, RegistryConfig

log = logging.getLogger(__name__)


def create_app(
    router: Router,
    me: Instance | None = None,
    api_key: str = "",
    max_in_flight: int = 0,
    request_timeout: float = 0,
    kserve_address: str = "",
    shutdown_grace_s: float = 10.0,
    processor: ProcessorClient | None = None,
    stored: ResponseStore | None = None,
    reuse_port: bool = False,
    batch: BatchSettings | None = None,
) -> FastAPI:
    """The app, routing to the processors `router` finds (or calling `processor`, if
    given, with its own deadline); registered as `me` if given. With `api_key`, /v1
    requests need it as a Bearer token. With `kserve_address`, KServe v2 gRPC is served
    there too, with the same key, bound and deadline, on a port shared with other
    processes only with `reuse_port`. `stored`: the Responses API's store (by default, one
    in memory with the flags' defaults); `batch`: where the Batch API keeps its batches (by
    default, the flags' directory)."""
    processor = processor or GrpcProcessorClient(router, request_timeout)
    # One bound on generations in flight, whichever door they came in by.
    limit = InFlightLimit(max_in_flight, "generations")
    authorize = functools.partial(middleware.authorize, api_key)
    lifespan = functools.partial(
        _lifespan,
        registry=router.registry,
        me=me,
        kserve_address=kserve_address,
        reuse_port=reuse_port,
        limit=limit,
        authorize=authorize,
        shutdown_grace_s=shutdown_grace_s,
    )
    app = FastAPI(title="Prism", version=prism.__version__, lifespan=lifespan)
    app.state.processor = processor
    app.state.responses = stored or ResponseStore()
    app.state.interactive = limit
    app.state.batches = batch or BatchSettings.of(GatewayConfig())
    tracing.instrument_app(app, "gateway")
    # Inside the front door: its id, key and bound hold for the generations too.
    app.add_middleware(hot.HotPaths, routes=app.routes)
    # Outermost, so that the id is set before the request's span and every log line.
    app.add_middleware(middleware.FrontDoor, api_key=api_key, limit=limit)
    app.add_exception_handler(PrismError, middleware.prism_error)
    app.add_exception_handler(HTTPException, middleware.http_error)
    app.add_exception_handler(RequestValidationError, middleware.validation_error)
    for endpoints in (health, models, chat, completions, responses, lora, messages, batches):
        app.include_router(endpoints.router)
    openapi.describe(app)
    return app


@asynccontextmanager
async def _lifespan(
    app: FastAPI,
    *,
    registry: Registry,
    me: Instance | None,
    kserve_address: str,
    reuse_port: bool,
    limit: InFlightLimit,
    authorize: Callable[[str], None],
    shutdown_grace_s: float,
) -> AsyncIterator[None]:
    """Finds the processors and registers `me`; serves KServe at `kserve_address`, if
    given, until the app ends."""
    processor: ProcessorClient = app.state.processor
    await registry.watch("processor")
    if me is not None:
        await registry.register(me)
    server = tracker = None
    if kserve_address:
        server = await kserve.start(kserve_address, processor, limit, authorize, reuse_port)
        app.state.kserve = server
        tracker = asyncio.create_task(health.track(server, processor))
        log.info("KServe v2 gRPC on %s", kserve_address)
    try:
        yield
    finally:
        if server is not None and tracker is not None:
            tracker.cancel()
            server.draining = True
            await server.set_serving([kserve.SERVICE], serving=False)
            await server.server.stop(shutdown_grace_s)
        await registry.close()
        await processor.close()


class FrontSettings(Protocol):
    """What a front's config (prism.config.commands) says of its doors and the registry."""

    address: AddressConfig
    gateway: GatewayConfig
    limit: LimitConfig
    registry: RegistryConfig
    connect: ConnectConfig


def build(
    config: FrontSettings,
    host: str,
    port: int,
    shutdown_grace_s: float,
    peers: Sequence[str] = (),
    processor: ProcessorClient | None = None,
    stored: ResponseStore | None = None,
) -> FastAPI:
    """The app of a front answering HTTP at `host`:`port` (and KServe on its port), calling
    `processor` if given, else the processors its registry (`peers`, if static) lists;
    its Responses API keeps `stored`, if given, else a store of the flags'."""
    gateway, kserve_port = config.gateway, config.gateway.kserve_grpc_port
    return create_app(
        Router(open_registry(config.registry, peers, config.connect)),
        instance("gateway", advertise_host(config.registry, host), port, health="http"),
        api_key=gateway.api_key,
        max_in_flight=config.limit.max_in_flight,
        request_timeout=gateway.request_timeout,
        kserve_address=f"{host}:{kserve_port}" if kserve_port else "",
        shutdown_grace_s=shutdown_grace_s,
        processor=processor,
        stored=stored or ResponseStore.of(gateway),
        reuse_port=config.address.reuse_port,
        batch=BatchSettings.of(gateway),
    )


def serve(config: GatewayStageConfig) -> None:
    address = config.address
    # uvicorn binds the HTTP port itself, shared by none.
    ensure_free("HTTP", address.host, address.port)
    ensure_free("KServe gRPC", address.host, config.gateway.kserve_grpc_port)
    tracing.setup("gateway")
    app = build(config, address.host, address.port, address.shutdown_grace_s, config.peers.peer)
    log.info("gateway listening on http://%s:%d", address.host, address.port)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=address.host,
        port=address.port,
        log_level="warning",
        # uvicorn's lines through the process's own handler (and format: JSON too).
        log_config=None,
        access_log=False,
        timeout_keep_alive=config.gateway.http_keep_alive_s,
        timeout_graceful_shutdown=address.shutdown_grace_s,
    )
