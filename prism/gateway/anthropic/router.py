"""POST /v1/messages: Anthropic's Messages API over the processor's chat call, whole or
streamed, and /v1/messages/count_tokens over its CountTokens call, with Anthropic's error
body (prism.gateway.middleware picks it by path)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prism import logs
from prism.gateway import bodies
from prism.gateway.anthropic.answer import sse
from prism.gateway.anthropic.convert import chat_body
from prism.gateway.anthropic.messenger import Chat, OpenedMessage, open_message
from prism.gateway.anthropic.schemas import CountTokensRequest, MessagesRequest, error_body
from prism.gateway.client import ProcessorClient
from prism.gateway.openai.chat import chat_request
from prism.gateway.streaming import EventStream, unless_gone
from prism.proto.v1 import inference_pb2
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


@router.post("/v1/messages/count_tokens", openapi_extra=bodies.openapi(CountTokensRequest))
async def count_tokens(request: Request) -> JSONResponse:
    body = bodies.decode(await request.body(), CountTokensRequest)
    chat = chat_request(chat_body(body.as_message()))
    processor: ProcessorClient = request.app.state.processor
    try:
        reply = await processor.count_tokens(inference_pb2.CountTokensRequest(chat=chat))
    except grpc.aio.AioRpcError as exc:
        raise PrismError.from_rpc_error(exc) from None
    # As vLLM's server answers it.
    tokens = reply.input_tokens
    return JSONResponse(
        {"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}}
    )
