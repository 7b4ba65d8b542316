"""The HTTP front door: OpenAI's REST API over the processor's gRPC `InferenceService`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from prism import logs, rpc, telemetry, tracing
from prism.gateway import translate
from prism.gateway.client import GrpcProcessorClient, ProcessorClient
from prism.gateway.kserve import servicer as kserve
from prism.registry import Instance, instance, open_registry
from prism.routing import Router
from prism.rpc import PrismError, invalid, multiplex
from prism.runtime.stage import freeze_startup_heap
from prism.v1 import errors_pb2, inference_pb2

log = logging.getLogger(__name__)


def _error(error: PrismError) -> JSONResponse:
    headers = {}
    if "retry_after_s" in error.metadata:
        headers["Retry-After"] = error.metadata["retry_after_s"]
    elif error.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = translate.error_body(error, logs.REQUEST_ID.get())
    return JSONResponse(body, status_code=error.http_status, headers=headers)


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None


def _sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _open_stream(call: multiplex.Call) -> tuple[Any, AsyncIterator]:
    """Reads the first message, so that errors become HTTP statuses before any byte is sent."""
    iterator = call.__aiter__()
    try:
        first = await iterator.__anext__()
    except grpc.aio.AioRpcError as exc:
        raise PrismError.from_rpc_error(exc) from None
    except StopAsyncIteration:
        raise PrismError(grpc.StatusCode.INTERNAL, "empty response stream") from None
    return first, iterator


async def _generate(
    call: multiplex.Call,
    stream: bool,
    options: translate.StreamOptions,
    chunk: Callable[[Any, bool], dict],
    final: Callable[[dict[int, list], Any], dict],
    endpoint: str,
) -> JSONResponse | EventStream:
    """Runs a Chat or Complete call and answers as one JSON body or as SSE. `chunk` makes
    the SSE event of a message (the first of its choice or not); `final` the body from
    each choice's messages and the last message."""
    timer = telemetry.RequestTimer(endpoint)
    try:
        first, rest = await _open_stream(call)
    except BaseException:
        call.cancel()
        timer.finish(completed=False)
        raise
    timer.reply(first)
    if not stream:
        choices, last = {first.index: [first]}, first
        try:
            async for message in rest:
                timer.reply(message)
                choices.setdefault(message.index, []).append(message)
                last = message
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            timer.finish(completed=bool(last.finish_reason))
        return JSONResponse(final(dict(sorted(choices.items())), last))

    async def events() -> AsyncIterator[bytes]:
        """The stream's bytes: each write carries every message that was ready for it."""
        completed = False
        started: set[int] = set()

        def event(message: Any) -> bytes:
            payload = chunk(message, message.index not in started)
            started.add(message.index)
            if options.include_usage:
                # vLLM's server reports usage so far only where both are asked.
                continuous = options.continuous_usage_stats
                payload["usage"] = translate.usage(message.usage) if continuous else None
            return _sse(payload)

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
                payload = chunk(last, False)
                payload["choices"] = []
                payload["usage"] = translate.usage(last.usage)
                tail = _sse(payload)
            completed = True
            yield tail + b"data: [DONE]\n\n"
        except grpc.aio.AioRpcError as exc:
            # Headers are gone already: report in the stream, as vLLM's server does.
            body = translate.error_body(PrismError.from_rpc_error(exc), logs.REQUEST_ID.get())
            yield _sse(body) + b"data: [DONE]\n\n"
        finally:
            # A client that disconnects lands here: cancelling aborts the whole chain.
            call.cancel()
            timer.finish(completed)

    return EventStream(events())


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

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})  # fmt: skip
        task = asyncio.current_task()
        assert task is not None
        streaming = True
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:
                disconnected = True
                task.cancel()

        watcher = asyncio.create_task(watch())
        try:
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # Only the watcher's own cancel ends the request quietly.
            if not disconnected or task.uncancel() > 0:
                raise
        finally:
            streaming = False
            watcher.cancel()
            await self.chunks.aclose()  # type: ignore[attr-defined]


# Routes counted by path in the request metrics; anything else counts as "other".
_GENERATIONS = ("/v1/chat/completions", "/v1/completions")
_ROUTES = (*_GENERATIONS, "/v1/models")


class FrontDoor:
    """What every HTTP request meets first: an id (the client's `x-request-id` if it is a
    sane one, returned in the response headers), the API key when one is set, the bound
    on generations in flight, and the count of requests by final status.

    Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would run the app in
    another task and get in the way of streaming and disconnect handling."""

    def __init__(self, app: Any, api_key: str, limit: rpc.InFlightLimit):
        self.app = app
        self.api_key = api_key
        self.limit = limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(logs.HEADER.encode(), b"").decode("latin-1")
        request_id = given if logs.CLIENT_ID.fullmatch(given) else uuid.uuid4().hex
        token = logs.REQUEST_ID.set(request_id)
        status = 0

        async def send_with_id(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (logs.HEADER.encode(), request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        path = scope["path"]
        try:
            if path.startswith("/v1/"):
                authorize(self.api_key, headers.get(b"authorization", b"").decode("latin-1"))
            if path in _GENERATIONS:
                with self.limit.admit():
                    await self.app(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except PrismError as error:
            await _error(error)(scope, receive, send_with_id)
        except Exception as exc:
            if status:
                raise
            # Starlette's own answer would be a bare text 500.
            await _error(rpc.status_for(exc, "gateway"))(scope, receive, send_with_id)
        finally:
            logs.REQUEST_ID.reset(token)
            if path.startswith("/v1/"):
                endpoint = path if path in _ROUTES else "other"
                telemetry.REQUESTS.labels(endpoint, str(status or 500)).inc()


def authorize(api_key: str, authorization: str) -> None:
    """Raises unless `authorization` (an HTTP header, or gRPC metadata) carries `api_key`
    as a Bearer token; passes all when no key is set."""
    if not api_key:
        return
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), api_key):
        raise PrismError(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong API key: send 'Authorization: Bearer <key>'",
            reason=errors_pb2.ERROR_REASON_INVALID_API_KEY,
        )


async def _healthy(gateway: ProcessorClient, kserve_server: rpc.Server | None) -> bool:
    """Whether the processor can serve; the KServe port's gRPC health says the same."""
    serving = await gateway.healthy()
    if kserve_server is not None:
        await kserve_server.set_serving([kserve.SERVICE], serving)
    return serving


async def _track_health(server: rpc.Server, gateway: ProcessorClient, period: float = 1.0) -> None:
    """The KServe port's gRPC health between /health checks (each of which sets it too)."""
    while True:
        await _healthy(gateway, server)
        await asyncio.sleep(period)


def create_app(
    router: Router,
    me: Instance | None = None,
    api_key: str = "",
    max_in_flight: int = 0,
    request_timeout: float = 0,
    kserve_address: str = "",
    shutdown_grace_s: float = 10.0,
) -> FastAPI:
    """The app, routing to the processors `router` finds; registered as `me` if given.
    With `api_key`, /v1 requests need it as a Bearer token. With `kserve_address`, KServe
    v2 gRPC is served there too, with the same key, bound and deadline."""
    gateway = GrpcProcessorClient(router, request_timeout)
    registry = router.registry
    # One bound on generations in flight, whichever door they came in by.
    limit = rpc.InFlightLimit(max_in_flight, "generations")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await registry.watch("processor")
        if me is not None:
            await registry.register(me)
        server = health = None
        if kserve_address:
            server = await kserve.start(
                kserve_address, gateway, limit, functools.partial(authorize, api_key)
            )
            app.state.kserve = server
            health = asyncio.create_task(_track_health(server, gateway))
            log.info("KServe v2 gRPC on %s", kserve_address)
        try:
            yield
        finally:
            if server is not None and health is not None:
                health.cancel()
                server.draining = True
                await server.set_serving([kserve.SERVICE], serving=False)
                await server.server.stop(shutdown_grace_s)
            await registry.close()
            await gateway.close()

    app = FastAPI(title="Prism", lifespan=lifespan)
    tracing.instrument_app(app)
    # Outermost, so that the id is set before the request's span and every log line.
    app.add_middleware(FrontDoor, api_key=api_key, limit=limit)

    @app.exception_handler(PrismError)
    async def prism_error(request: Request, exc: PrismError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        code = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED}.get(
            exc.status_code, grpc.StatusCode.INVALID_ARGUMENT
        )
        body = translate.error_body(PrismError(code, str(exc.detail)))
        return JSONResponse(body, status_code=exc.status_code)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health() -> JSONResponse:
        if await _healthy(gateway, getattr(app.state, "kserve", None)):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        try:
            reply = await gateway.list_models()
        except (grpc.aio.AioRpcError, PrismError) as exc:
            error = rpc.status_for(exc)
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
                "root": m.id,
                "max_model_len": m.max_model_len,
            }
            for m in reply.models
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _json_body(request)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        message = translate.chat_request(body, request_id)
        options = translate.stream_options(body)
        created = int(time.time())
        wants_logprobs = message.sampling.HasField("logprobs")

        def logprobs(positions: list) -> dict | None:
            if not wants_logprobs:
                return None
            return translate.chat_logprobs(positions, message.sampling.logprobs)

        def head(reply: inference_pb2.ChatResponse, kind: str) -> dict:
            return {"id": request_id, "object": kind, "created": created, "model": reply.model}

        def chunk(reply: inference_pb2.ChatResponse, first: bool) -> dict:
            delta = translate.chat_delta(reply)
            if first:
                delta = {"role": "assistant", **delta}
            choice = {
                "index": reply.index,
                "delta": delta,
                "logprobs": logprobs(list(reply.logprobs)),
                "finish_reason": translate.finish_reason(reply.finish_reason),
            }
            return {**head(reply, "chat.completion.chunk"), "choices": [choice]}

        def choice(index: int, replies: list[inference_pb2.ChatResponse]) -> dict:
            end = replies[-1]
            if end.HasField("parsed"):
                message = translate.chat_message(end.parsed)
                reason = end.parsed.finish_reason
            else:
                text = "".join(reply.text for reply in replies)
                message, reason = {"role": "assistant", "content": text}, end.finish_reason
            return {
                "index": index,
                "message": message,
                "logprobs": logprobs([p for r in replies for p in r.logprobs]),
                "finish_reason": translate.finish_reason(reason),
            }

        def final(choices: dict[int, list], last: inference_pb2.ChatResponse) -> dict:
            return {
                **head(last, "chat.completion"),
                "choices": [choice(index, replies) for index, replies in choices.items()],
                "usage": translate.usage(last.usage),
            }

        call = gateway.chat(message)
        try:
            return await _generate(
                call, translate.wants_stream(body), options, chunk, final, request.url.path
            )
        except PrismError as error:
            raise translate.as_sent(error, body) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json_body(request)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        message = translate.completion_request(body, request_id)
        options = translate.stream_options(body)
        created = int(time.time())
        wants_logprobs = message.sampling.HasField("logprobs")
        # Each choice's next text offset, for logprobs streamed chunk by chunk.
        offsets: dict[int, int] = {}

        def choice(index: int, replies: list[inference_pb2.CompleteResponse]) -> dict:
            body: dict[str, Any] = {
                "index": index,
                "text": "".join(reply.text for reply in replies),
                "logprobs": None,
                "finish_reason": translate.finish_reason(replies[-1].finish_reason),
            }
            if wants_logprobs:
                positions = [p for reply in replies for p in reply.logprobs]
                logprobs = translate.completion_logprobs(
                    positions, message.sampling.logprobs, offsets.get(index, 0)
                )
                if positions:
                    offsets[index] = logprobs["text_offset"][-1] + len(positions[-1].token.token)
                body["logprobs"] = logprobs
            prompt = [p for reply in replies for p in reply.prompt_logprobs]
            if prompt:
                body["prompt_logprobs"] = translate.prompt_logprobs(prompt)
            return body

        def head(reply: inference_pb2.CompleteResponse) -> dict:
            return {"id": request_id, "object": "text_completion", "created": created,
                    "model": reply.model}  # fmt: skip

        def chunk(reply: inference_pb2.CompleteResponse, first: bool) -> dict:
            return {**head(reply), "choices": [choice(reply.index, [reply])]}

        def final(choices: dict[int, list], last: inference_pb2.CompleteResponse) -> dict:
            return {
                **head(last),
                "choices": [choice(index, replies) for index, replies in choices.items()],
                "usage": translate.usage(last.usage),
            }

        call = gateway.complete(message)
        try:
            return await _generate(
                call, translate.wants_stream(body), options, chunk, final, request.url.path
            )
        except PrismError as error:
            raise translate.as_sent(error, body) from None

    return app


def serve(args: argparse.Namespace) -> None:
    tracing.setup("gateway")
    app = create_app(
        Router(open_registry(args)),
        instance(args, "gateway", args.port, health="http"),
        api_key=args.api_key,
        max_in_flight=args.max_in_flight,
        request_timeout=args.request_timeout,
        kserve_address=f"{args.host}:{args.kserve_grpc_port}" if args.kserve_grpc_port else "",
        shutdown_grace_s=args.shutdown_grace_s,
    )
    log.info("gateway listening on http://%s:%d", args.host, args.port)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=args.shutdown_grace_s,
    )
