"""What every HTTP request meets around its endpoint, once for all of them: its request
id, the API key, the bound on generations in flight, the count by final status, and every
error answered as its API's error body (OpenAI's, or Anthropic's under /v1/messages)."""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Callable
from typing import Any

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from prism import logs, telemetry
from prism.gateway.anthropic import schemas as anthropic
from prism.gateway.openai.protocol import error_body
from prism.proto.v1 import errors_pb2
from prism.rpc.errors import PrismError, invalid, status_for
from prism.rpc.server import InFlightLimit

# Routes counted by path in the request metrics; anything else counts as "other".
GENERATIONS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
_ROUTES = (*GENERATIONS, "/v1/models")


def _error_body(error: PrismError, path: str) -> dict[str, Any]:
    """The error body of the API `path` belongs to: Anthropic's or OpenAI's."""
    write = anthropic.error_body if path.startswith("/v1/messages") else error_body
    return write(error, logs.REQUEST_ID.get())


def error_response(error: PrismError, path: str = "") -> JSONResponse:
    headers = {}
    if "retry_after_s" in error.metadata:
        headers["Retry-After"] = error.metadata["retry_after_s"]
    elif error.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    body = _error_body(error, path)
    return JSONResponse(body, status_code=error.http_status, headers=headers)


async def prism_error(request: Request, exc: PrismError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's refusal of a parameter it reads (a query's, a form's) as the API's error
    body, naming it (FastAPI's own would be a 422 of its shape)."""
    first = exc.errors()[0]
    param = ".".join(str(part) for part in first["loc"][1:])
    error = invalid(f"'{param}': {first['msg']}", param)
    return JSONResponse(_error_body(error, request.url.path), status_code=error.http_status)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route or method) as the API's error body."""
    code = {404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED}.get(
        exc.status_code, grpc.StatusCode.INVALID_ARGUMENT
    )
    body = _error_body(PrismError(code, str(exc.detail)), request.url.path)
    return JSONResponse(body, status_code=exc.status_code)


class FrontDoor:
    """What every HTTP request meets first: an id (the client's `x-request-id` if it is a
    sane one, returned in the response headers), the API key when one is set, the bound
    on generations in flight, and the count of requests by final status.

    Pure ASGI rather than Starlette's BaseHTTPMiddleware, which would run the app in
    another task and get in the way of streaming and disconnect handling."""

    def __init__(self, app: Any, api_key: str, limit: InFlightLimit):
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
                authorize(self.api_key, _authorization(headers))
            if path in GENERATIONS:
                with self.limit.admit():
                    await self.app(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except PrismError as error:
            await error_response(error, path)(scope, receive, send_with_id)
        except Exception as exc:
            if status:
                raise
            # Starlette's own answer would be a bare text 500.
            failure = error_response(status_for(exc, "gateway"), path)
            await failure(scope, receive, send_with_id)
        finally:
            logs.REQUEST_ID.reset(token)
            if path.startswith("/v1/"):
                endpoint = path if path in _ROUTES else "other"
                telemetry.REQUESTS.labels(endpoint, str(status or 500)).inc()


def _authorization(headers: dict[bytes, bytes]) -> str:
    """The request's credentials as an Authorization header: its own, or Anthropic's
    `x-api-key` (what the anthropic SDK sends) as a Bearer token."""
    given = headers.get(b"authorization")
    if given is None and b"x-api-key" in headers:
        given = b"Bearer " + headers[b"x-api-key"]
    return (given or b"").decode("latin-1")


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
