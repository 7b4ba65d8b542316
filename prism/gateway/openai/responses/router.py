"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the
processor's chat call (prism.gateway.openai.responses.respond), with a bounded store of
responses for `previous_response_id`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prism import logs
from prism.gateway import bodies
from prism.gateway.openai import schemas
from prism.gateway.openai.protocol import error_body
from prism.gateway.openai.responses.respond import Opened, Responder
from prism.gateway.openai.responses.store import ResponseStore
from prism.gateway.streaming import EventStream, unless_gone
from prism.rpc.errors import PrismError, invalid

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses", openapi_extra=bodies.openapi(schemas.ResponsesRequest))
async def create(request: Request) -> Response:
    body = bodies.decode(await request.body(), schemas.ResponsesRequest)
    responder = Responder(_store(request), request.app.state.processor.chat)
    return await unless_gone(request.receive, _answer(responder, body, request.url.path))


async def _answer(responder: Responder, body: Any, path: str) -> Response:
    opened = await responder.open(body, path)
    if opened.stream:
        return EventStream(_events(opened))
    return JSONResponse(await opened.whole())


async def _events(opened: Opened) -> AsyncIterator[bytes]:
    try:
        # Closed at once if the client goes: the generation ends with it.
        async with contextlib.aclosing(opened.events()) as stream:
            async for events in stream:
                yield _sse(events)
    except PrismError as error:
        # Headers are gone already: an error event, as vLLM's server sends one.
        yield _sse([opened.answer.failure(error_body(error, logs.REQUEST_ID.get())["error"])])


def _sse(events: list[dict[str, Any]]) -> bytes:
    return b"".join(
        f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
        for event in events
    )


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(_store(request).get(response_id).response)


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> JSONResponse:
    _store(request).delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel(response_id: str, request: Request) -> JSONResponse:
    _store(request).get(response_id)
    # Every response here is answered in its request (no background mode): nothing to
    # cancel, as vLLM's server says of one.
    raise invalid("Cannot cancel a synchronous response.", "response_id")
