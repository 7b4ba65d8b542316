"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded
at run time, with vLLM's bodies and answers (prism.services.processor.adapters does it)."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from prism.gateway import bodies
from prism.gateway.client import ProcessorClient
from prism.gateway.openai import schemas
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import status_for

router = APIRouter()


async def _call(
    request: Request, message: inference_pb2.LoadAdapterRequest | inference_pb2.UnloadAdapterRequest
) -> None:
    processor: ProcessorClient = request.app.state.processor
    try:
        await processor.adapter(message)
    except grpc.aio.AioRpcError as exc:
        raise status_for(exc) from None


@router.post("/v1/load_lora_adapter", openapi_extra=bodies.openapi(schemas.LoadLoraAdapterRequest))
async def load(request: Request) -> PlainTextResponse:
    body = bodies.decode(await request.body(), schemas.LoadLoraAdapterRequest)
    name, path = body.lora_name, body.lora_path
    await _call(request, inference_pb2.LoadAdapterRequest(name=name, path=path))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter", openapi_extra=bodies.openapi(schemas.UnloadLoraAdapterRequest)
)
async def unload(request: Request) -> PlainTextResponse:
    name = bodies.decode(await request.body(), schemas.UnloadLoraAdapterRequest).lora_name
    await _call(request, inference_pb2.UnloadAdapterRequest(name=name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
