"""GET /v1/models: the processor's served models, as vLLM's OpenAI server lists them: the
base model, and each LoRA adapter with the base as its parent."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prism.gateway.client import ProcessorClient
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import PrismError, status_for

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    processor: ProcessorClient = request.app.state.processor
    try:
        reply = await processor.list_models()
    except (grpc.aio.AioRpcError, PrismError) as exc:
        error = status_for(exc)
        if error.code != grpc.StatusCode.UNAVAILABLE:
            raise error from None
        # No processor to ask: no model can be served yet.
        reply = inference_pb2.ListModelsResponse()
    data = [
        {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
            "root": m.root or m.id,
            "parent": m.parent or None,
            "max_model_len": m.max_model_len,
        }
        for m in reply.models
    ]
    return JSONResponse({"object": "list", "data": data})
