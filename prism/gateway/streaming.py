"""A generation's answer over HTTP, for chat and completions alike: one JSON body, or
server-sent events as the processor's messages come. The first message is read before
anything is sent, so that errors become HTTP statuses while they still can."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from json.encoder import encode_basestring_ascii
from typing import Any, Protocol

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from prism import logs, telemetry
from prism.gateway.client import ReplyStream
from prism.gateway.openai.protocol import as_sent, error_body, finish_reason, usage
from prism.gateway.openai.schemas import Sampling, StreamOptions
from prism.rpc.errors import PrismError


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _json_bytes(value: str | None) -> bytes:
    """A string or null as `sse`'s JSON writes it (json.dumps's own C encoder)."""
    return b"null" if value is None else encode_basestring_ascii(value).encode()


class PlainChunks:
    """A request's SSE chunks of plain text as `sse` writes them, without their closing
    brace: the head (id, object, created, model) made once, then the choice, whose text
    goes between `before` and `after` (`"delta":{"content":` for a chat)."""

    def __init__(
        self, request_id: str, kind: str, created: int, before: bytes, after: bytes
    ) -> None:
        self._head = {"id": request_id, "object": kind, "created": created}
        self._before = b"," + before
        self._after = after + b',"logprobs":null,"finish_reason":'
        # By model name: a request's replies all carry the same one.
        self._heads: dict[str, bytes] = {}

    def of(self, reply: Any) -> bytes:
        head = self._heads.get(reply.model)
        if head is None:
            head = sse({**self._head, "model": reply.model})[6:-3] + b',"choices":[{"index":'
            self._heads[reply.model] = head
        return b"".join((
            head, str(reply.index).encode(), self._before, _json_bytes(reply.text), self._after,
            _json_bytes(finish_reason(reply.finish_reason)), b"}]",
        ))  # fmt: skip


class EndpointAnswer(Protocol):
    """How an endpoint writes a call's messages: an SSE event each, or one whole body."""

    def chunk(self, reply: Any, first: bool) -> dict:
        """A message's SSE event (the first of its choice or not)."""

    def plain(self, reply: Any, first: bool) -> bytes | None:
        """The same event's JSON as bytes, without its closing brace, where the message is
        plain text (the common case, built from bytes made once per request); else None."""

    def final(self, choices: dict[int, list], last: Any) -> dict:
        """The whole body, from each choice's messages and the last message."""


async def open_stream(
    call: ReplyStream, endpoint: str
) -> tuple[Any, AsyncIterator, telemetry.RequestTimer]:
    """Reads the first message, so that errors become HTTP statuses before any byte is sent,
    and times the call as `endpoint`'s. Where that fails (its caller gone too), the call is
    cancelled: the generation ends with it."""
    timer = telemetry.RequestTimer(endpoint)
    iterator = call.__aiter__()
    try:
        first = await iterator.__anext__()
    except BaseException as exc:
        call.cancel()
        timer.finish(completed=False)
        if isinstance(exc, grpc.aio.AioRpcError):
            raise PrismError.from_rpc_error(exc) from None
        if isinstance(exc, StopAsyncIteration):
            raise PrismError(grpc.StatusCode.INTERNAL, "empty response stream") from None
        raise
    timer.reply(first)
    return first, iterator, timer


async def generate(
    call: ReplyStream, stream: bool, options: StreamOptions, answer: EndpointAnswer, endpoint: str
) -> Response:
    """Runs a Chat or Complete call and answers as one JSON body (`answer.final`'s) or as
    SSE (an event per message)."""
    first, rest, timer = await open_stream(call, endpoint)
    if not stream:
        try:
            return await _whole(first, rest, timer, answer)
        except BaseException:
            call.cancel()
            raise
    return EventStream(_events(call, first, rest, timer, options, answer))


async def respond(
    request: Request, body: Sampling, answer: EndpointAnswer, start: Callable[[], ReplyStream]
) -> Response:
    """An OpenAI generation endpoint's reply to `body`. `start` makes the processor call;
    errors name the parameter as the client sent it."""
    options = body.stream_options or StreamOptions()
    call = start()
    try:
        return await unless_gone(
            request.receive, generate(call, bool(body.stream), options, answer, request.url.path)
        )
    except PrismError as error:
        raise as_sent(error, body) from None


class ClientWatch:
    """Cancels the task that made it if the client disconnects before `close`: whatever
    it awaits for that client (a processor call) ends with it."""

    def __init__(self, receive: Callable) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self._gone = False
        self._open = True
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Callable) -> None:
        # The ASGI server's receive, once the body is read: http.disconnect, and again
        # to each later call.
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._open:
            self._gone = True
            self.task.cancel()

    def quiet(self) -> bool:
        """On a CancelledError: whether this watch's was the only cancel (the client gone,
        nothing else), so that the request ends quietly."""
        return self._gone and self.task.uncancel() == 0

    def close(self) -> None:
        self._open = False
        self._watcher.cancel()


async def unless_gone(receive: Callable, answer: Awaitable[Response]) -> Response:
    """`answer`'s response, unless the client disconnects first: a generation waiting for
    its first token, or answered whole, ends then, not when its tokens are all computed
    for nobody; the response nobody reads is a 499 (nginx's "client closed request"). An
    event stream takes the watch on (the same task writes it), rather than a second one
    watching the same client."""
    watch = ClientWatch(receive)
    try:
        response = await answer
    except asyncio.CancelledError:
        watch.close()
        if not watch.quiet():
            raise
        return Response(status_code=499)
    except BaseException:
        watch.close()
        raise
    if isinstance(response, EventStream):
        response.watch = watch
    else:
        watch.close()
    return response


async def read_all(first: Any, rest: AsyncIterator, timer: telemetry.RequestTimer) -> list[Any]:
    """A call's messages, `first` then the `rest`, each timed; a failure raises PrismError."""
    replies = [first]
    try:
        async for reply in rest:
            timer.reply(reply)
            replies.append(reply)
    except grpc.aio.AioRpcError as exc:
        raise PrismError.from_rpc_error(exc) from None
    finally:
        timer.finish(completed=bool(replies[-1].finish_reason))
    return replies


async def _whole(
    first: Any, rest: AsyncIterator, timer: telemetry.RequestTimer, answer: EndpointAnswer
) -> JSONResponse:
    choices: dict[int, list] = {}
    for message in await read_all(first, rest, timer):
        choices.setdefault(message.index, []).append(message)
    return JSONResponse(answer.final(dict(sorted(choices.items())), message))


async def _events(
    call: ReplyStream,
    first: Any,
    rest: AsyncIterator,
    timer: telemetry.RequestTimer,
    options: StreamOptions,
    answer: EndpointAnswer,
) -> AsyncIterator[bytes]:
    """The stream's bytes: each write carries every message that was ready for it."""
    completed = False
    started: set[int] = set()
    # vLLM's server reports usage so far only where both are asked.
    continuous = options.include_usage and options.continuous_usage_stats

    def event(message: Any) -> bytes:
        first = message.index not in started
        started.add(message.index)
        plain = answer.plain(message, first)
        if plain is None:
            payload = answer.chunk(message, first)
            if options.include_usage:
                payload["usage"] = usage(message.usage) if continuous else None
            return sse(payload)
        if continuous:
            plain += b',"usage":' + json.dumps(usage(message.usage), separators=(",", ":")).encode()
        elif options.include_usage:
            plain += b',"usage":null'
        return b"data: " + plain + b"}\n\n"

    try:
        message: Any = first
        while True:
            written = []
            while message is not None:
                written.append(event(message))
                last = message
                if (message := call.ready()) is not None:
                    timer.reply(message)
            yield b"".join(written)
            try:
                message = await rest.__anext__()
            except StopAsyncIteration:
                break
            timer.reply(message)
        tail = b""
        if options.include_usage:
            payload = answer.chunk(last, False)
            payload["choices"] = []
            payload["usage"] = usage(last.usage)
            tail = sse(payload)
        completed = True
        yield tail + b"data: [DONE]\n\n"
    except grpc.aio.AioRpcError as exc:
        # Headers are gone already: report in the stream, as vLLM's server does.
        body = error_body(PrismError.from_rpc_error(exc), logs.REQUEST_ID.get())
        yield sse(body) + b"data: [DONE]\n\n"
    finally:
        # A client that disconnects lands here: cancelling aborts the whole chain.
        call.cancel()
        timer.finish(completed)


class EventStream(Response):
    """A server-sent event stream written straight to the ASGI server: one write per chunk,
    and a client that disconnects cancels the stream (whose cleanup then runs) without
    failing the request. Starlette's StreamingResponse does both at a cost per request
    (a task group) and per chunk (anyio) that showed in profiles under load."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        # As StreamingResponse: no body, hence no content-length.
        self.status_code = 200
        self.background = None
        self.init_headers()
        self.chunks = chunks
        # The watch on the client that the stream's first message was awaited under.
        self.watch: ClientWatch | None = None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        watch = self.watch
        if watch is None or watch.task is not asyncio.current_task():
            if watch is not None:
                watch.close()
            watch = ClientWatch(receive)
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.close()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Only the watch's own cancel ends the request quietly.
            if not watch.quiet():
                raise
        finally:
            watch.close()
            await self.chunks.aclose()  # type: ignore[attr-defined]
