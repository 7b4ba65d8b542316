"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the
processor's chat call, with a bounded store of responses for `previous_response_id`."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from prism import logs, telemetry
from prism.gateway.client import ProcessorClient, ReplyStream
from prism.gateway.openai.chat import chat_request
from prism.gateway.openai.protocol import as_sent, error_body, json_body, wants_stream
from prism.gateway.openai.responses import items
from prism.gateway.openai.responses.answer import ResponseAnswer
from prism.gateway.openai.responses.store import ResponseStore, Stored
from prism.gateway.streaming import EventStream, open_stream
from prism.rpc.errors import PrismError, invalid

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


@router.post("/v1/responses")
async def create(request: Request) -> Response:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    store = _store(request)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise invalid("'previous_response_id' must be a string", "previous_response_id")
    before = store.get(previous, "previous_response_id").messages if previous else None
    talk = items.conversation(body, before)
    chat = items.chat_body(body, talk)
    # Read before the call starts: a bad value must not leave a generation running.
    stream = wants_stream(body)
    keep = store if items.stored(body) else None
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        message = chat_request(chat, response_id)
    except PrismError as error:
        raise _as_sent(error, talk, body) from None
    top = message.sampling.logprobs if message.sampling.HasField("logprobs") else None
    answer = ResponseAnswer(response_id, body, top)
    processor: ProcessorClient = request.app.state.processor
    call = processor.chat(message)
    timer = telemetry.RequestTimer(request.url.path)
    try:
        first, rest = await open_stream(call)
    except PrismError as error:
        call.cancel()
        timer.finish(completed=False)
        raise _as_sent(error, talk, body) from None
    timer.reply(first)

    def kept(response: dict[str, Any]) -> None:
        if keep is not None:
            keep.put(Stored(response, _turn(talk, response)))

    if stream:
        return EventStream(_events(call, first, rest, timer, answer, kept))
    replies = [first]
    try:
        async for reply in rest:
            timer.reply(reply)
            replies.append(reply)
    except grpc.aio.AioRpcError as exc:
        raise _as_sent(PrismError.from_rpc_error(exc), talk, body) from None
    finally:
        timer.finish(completed=bool(replies[-1].finish_reason))
    response = answer.whole(replies)
    kept(response)
    return JSONResponse(response)


def _turn(talk: items.Conversation, response: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a follow-up continues: this turn's, then its answer's text (its
    reasoning and calls left out, as vLLM's server leaves them)."""
    said = [
        {"role": "assistant", "content": part["text"]}
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    return [*talk.messages, *said]


def _as_sent(error: PrismError, talk: items.Conversation, body: dict) -> PrismError:
    error = as_sent(talk.error(error), body)
    if error.param == "max_tokens":
        error.message = error.message.replace("max_tokens", "max_output_tokens")
        error.param = "max_output_tokens"
    if error.param == "response_format":
        error.param = "text.format"
    return error


async def _events(
    call: ReplyStream,
    first: Any,
    rest: AsyncIterator,
    timer: telemetry.RequestTimer,
    answer: ResponseAnswer,
    kept: Callable[[dict[str, Any]], None],
) -> AsyncIterator[bytes]:
    completed = False
    try:
        written = answer.opening(first.model) + answer.event(first)
        yield _sse(written)
        last = first
        async for reply in rest:
            timer.reply(reply)
            last = reply
            yield _sse(answer.event(reply))
        events = answer.closing(last)
        kept(events[-1]["response"])
        completed = True
        yield _sse(events)
    except grpc.aio.AioRpcError as exc:
        # Headers are gone already: an error event, as vLLM's server sends one.
        error = error_body(PrismError.from_rpc_error(exc), logs.REQUEST_ID.get())["error"]
        yield _sse([answer.failure(error)])
    finally:
        call.cancel()
        timer.finish(completed)


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
