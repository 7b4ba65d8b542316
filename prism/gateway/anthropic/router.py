"""POST /v1/messages: Anthropic's Messages API over the processor's chat call, whole or
streamed, with Anthropic's error body (prism.gateway.middleware picks it by path)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prism import logs, telemetry
from prism.gateway import bodies
from prism.gateway.anthropic.answer import MessageAnswer, MessageEvents, sse
from prism.gateway.anthropic.convert import chat_body
from prism.gateway.anthropic.schemas import MessagesRequest, error_body
from prism.gateway.client import ReplyStream
from prism.gateway.openai.chat import chat_request
from prism.gateway.streaming import EventStream, open_stream, unless_gone
from prism.rpc.errors import PrismError

router = APIRouter()


@router.post("/v1/messages", openapi_extra=bodies.openapi(MessagesRequest))
async def create(request: Request) -> Response:
    body = bodies.decode(await request.body(), MessagesRequest)
    answer = MessageAnswer()
    message = chat_request(chat_body(body), answer.id)
    call = request.app.state.processor.chat(message)
    return await unless_gone(
        request.receive, _answer(call, bool(body.stream), answer, request.url.path)
    )


async def _answer(call: ReplyStream, stream: bool, answer: MessageAnswer, path: str) -> Response:
    timer = telemetry.RequestTimer(path)
    try:
        first, rest = await open_stream(call)
    except BaseException:
        call.cancel()
        timer.finish(completed=False)
        raise
    timer.reply(first)
    if stream:
        return EventStream(_events(call, first, rest, timer, MessageEvents(answer)))
    replies = [first]
    try:
        async for reply in rest:
            timer.reply(reply)
            replies.append(reply)
    except grpc.aio.AioRpcError as exc:
        raise PrismError.from_rpc_error(exc) from None
    except BaseException:
        call.cancel()
        raise
    finally:
        timer.finish(completed=bool(replies[-1].finish_reason))
    return JSONResponse(answer.whole(replies))


async def _events(
    call: ReplyStream,
    first: Any,
    rest: AsyncIterator,
    timer: telemetry.RequestTimer,
    events: MessageEvents,
) -> AsyncIterator[bytes]:
    completed = False
    try:
        yield sse(events.opening(first) + events.event(first))
        last = first
        async for reply in rest:
            timer.reply(reply)
            last = reply
            yield sse(events.event(reply))
        completed = True
        yield sse(events.closing(last))
    except grpc.aio.AioRpcError as exc:
        # Headers are gone already: an error event, as Anthropic's API sends one.
        error = error_body(PrismError.from_rpc_error(exc), logs.REQUEST_ID.get())
        yield sse([("error", error)])
    finally:
        # A client that disconnects lands here: cancelling aborts the whole chain.
        call.cancel()
        timer.finish(completed)
