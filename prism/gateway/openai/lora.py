"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded
at run time, with vLLM's bodies and answers (prism.services.processor.adapters does it)."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from prism.gateway.client import ProcessorClient
from prism.gateway.openai.protocol import json_body
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import invalid, status_for

router = APIRouter()


def _text(body: Any, key: str) -> str:
    value = body.get(key) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise invalid(f"'{key}' is required and must be a string", key)
    return value


async def _call(
    request: Request, message: inference_pb2.LoadAdapterRequest | inference_pb2.UnloadAdapterRequest
) -> None:
    processor: ProcessorClient = request.app.state.processor
    try:
        await processor.adapter(message)
    except grpc.aio.AioRpcError as exc:
        raise status_for(exc) from None


@router.post("/v1/load_lora_adapter")
async def load(request: Request) -> PlainTextResponse:
    body = await json_body(request)
    name, path = _text(body, "lora_name"), _text(body, "lora_path")
    await _call(request, inference_pb2.LoadAdapterRequest(name=name, path=path))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload(request: Request) -> PlainTextResponse:
    name = _text(await json_body(request), "lora_name")
    await _call(request, inference_pb2.UnloadAdapterRequest(name=name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
