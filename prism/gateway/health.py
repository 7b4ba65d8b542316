"""What orchestrators and scrapers ask the gateway, without an API key: /health (whether a
processor can serve; the KServe port's gRPC health says the same) and /metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prism.gateway.client import ProcessorClient
from prism.gateway.kserve.servicer import SERVICE
from prism.rpc.server import Server

router = APIRouter()


@router.get("/metrics")
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    if await healthy(state.processor, getattr(state, "kserve", None)):
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


async def healthy(processor: ProcessorClient, kserve_server: Server | None) -> bool:
    """Whether the processor can serve; the KServe port's gRPC health says the same."""
    serving = await processor.healthy()
    if kserve_server is not None:
        await kserve_server.set_serving([SERVICE], serving)
    return serving


async def track(server: Server, processor: ProcessorClient, period: float = 1.0) -> None:
    """The KServe port's gRPC health between /health checks (each of which sets it too)."""
    while True:
        await healthy(processor, server)
        await asyncio.sleep(period)
