"""POST /v1/messages: Anthropic's Messages API over the processor's chat call, whole or
streamed, with Anthropic's error body (prism.gateway.middleware picks it by path)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prism import logs
from prism.gateway import bodies
from prism.gateway.anthropic.answer import sse
from prism.gateway.anthropic.messenger import Chat, OpenedMessage, open_message
from prism.gateway.anthropic.schemas import MessagesRequest, error_body
from prism.gateway.streaming import EventStream, unless_gone
from prism.rpc.errors import PrismError

router = APIRouter()


@router.post("/v1/messages", openapi_extra=bodies.openapi(MessagesRequest))
async def create(request: Request) -> Response:
    body = bodies.decode(await request.body(), MessagesRequest)
    chat = request.app.state.processor.chat
    return await unless_gone(request.receive, _answer(chat, body, request.url.path))


async def _answer(chat: Chat, body: MessagesRequest, path: str) -> Response:
    opened = await open_message(chat, body, path)
    if opened.stream:
        return EventStream(_events(opened))
    return JSONResponse(await opened.whole())


async def _events(opened: OpenedMessage) -> AsyncIterator[bytes]:
    try:
        # Closed at once if the client goes: the generation ends with it.
        async with contextlib.aclosing(opened.events()) as stream:
            async for events in stream:
                yield sse(events)
    except PrismError as error:
        # Headers are gone already: an error event, as Anthropic's API sends one.
        yield sse([("error", error_body(error, logs.REQUEST_ID.get()))])
