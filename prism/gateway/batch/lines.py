"""A batch's input file as its lines (`read`, checked once when the batch is created), and
one line answered by the endpoint its `url` names: the same code as the HTTP request would
meet, called in this process, so that a line's answer is the one that request would get."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request

from prism import logs
from prism.gateway.batch.store import new_id
from prism.gateway.middleware import error_response
from prism.rpc.errors import PrismError, invalid, status_for

# The endpoints a batch may name (its lines' `url`).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


@dataclass(frozen=True)
class Line:
    """A line of the input file (`number` from 1): a request, or `problem` where the line
    is not one it can send (it fails alone, into the error file)."""

    number: int
    custom_id: str | None = None
    body: bytes = b""
    problem: str = ""


def read(data: bytes, endpoint: str, max_lines: int) -> list[Line]:
    """The file's lines that are not blank. A line that is not a JSON object is kept as a
    problem; a request that names no `custom_id`, another endpoint or method, or a
    `custom_id` seen before refuses the whole file (400, naming the line)."""
    lines: list[Line] = []
    seen: set[str] = set()
    for number, text in _numbered(data):
        if len(lines) == max_lines:
            raise invalid(f"the file has more than {max_lines} requests", "input_file_id")
        try:
            request = json.loads(text)
        except ValueError as exc:
            lines.append(Line(number, problem=f"line {number} is not valid JSON: {exc}"))
            continue
        if not isinstance(request, dict):
            lines.append(Line(number, problem=f"line {number} is not a JSON object"))
            continue
        custom_id = _check(request, number, endpoint)
        if custom_id in seen:
            raise invalid(f"line {number}: custom_id '{custom_id}' is used twice", "input_file_id")
        seen.add(custom_id)
        if request["body"].get("stream"):
            lines.append(Line(number, custom_id, problem=f"line {number}: a batch's requests "
                              "cannot be streamed"))  # fmt: skip
            continue
        body = json.dumps(request["body"], separators=(",", ":")).encode()
        lines.append(Line(number, custom_id, body))
    if not lines:
        raise invalid("the file has no requests", "input_file_id")
    return lines


def _numbered(data: bytes) -> Iterator[tuple[int, bytes]]:
    for number, text in enumerate(data.splitlines(), 1):
        if text.strip():
            yield number, text


def _check(request: dict[str, Any], number: int, endpoint: str) -> str:
    """The request's custom_id, once its fields are those of a request to `endpoint`."""
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise invalid(f"line {number}: missing custom_id (a string)", "input_file_id")
    if request.get("method") != "POST":
        raise invalid(f"line {number}: method must be 'POST'", "input_file_id")
    if request.get("url") != endpoint:
        raise invalid(f"line {number}: url {request.get('url')!r} is not the batch's endpoint "
                      f"'{endpoint}'", "input_file_id")  # fmt: skip
    if not isinstance(request.get("body"), dict):
        raise invalid(f"line {number}: body must be a JSON object", "input_file_id")
    return custom_id


def failure(line: Line, code: str, message: str) -> dict[str, Any]:
    """A line's entry in the error file where it got no response."""
    return {"id": new_id("batch_req_"), "custom_id": line.custom_id, "response": None,
            "error": {"code": code, "message": message}}  # fmt: skip


Endpoint = Callable[[Request], Awaitable[Any]]


def endpoints(routes: Sequence[Any]) -> dict[str, Endpoint]:
    """The endpoints of the app's POST routes a batch may name."""
    return {route.path: route.endpoint for route in routes
            if isinstance(route, APIRoute) and route.path in ENDPOINTS}  # fmt: skip


async def answer(app: Any, endpoint: Endpoint, path: str, line: Line) -> tuple[int, dict]:
    """The line's request answered by `endpoint`: its HTTP status and the line's entry in
    the output (2xx) or error file."""
    request_id = new_id("batch_req_")
    token = logs.REQUEST_ID.set(request_id)
    try:
        status, body = await _call(app, endpoint, path, line.body)
    finally:
        logs.REQUEST_ID.reset(token)
    response = {"status_code": status, "request_id": request_id, "body": body}
    return status, {"id": request_id, "custom_id": line.custom_id, "response": response,
                    "error": None}  # fmt: skip


async def _call(app: Any, endpoint: Endpoint, path: str, body: bytes) -> tuple[int, Any]:
    sent = False

    async def receive() -> dict[str, Any]:
        # The body once; then nothing, as a client that stays (cancelling the task ends
        # the request).
        nonlocal sent
        if sent:
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": [(b"content-type", b"application/json")],
             "app": app, "scheme": "http", "server": ("batch", 0)}  # fmt: skip
    try:
        response = await endpoint(Request(scope, receive))
    except Exception as exc:
        return _error(exc if isinstance(exc, PrismError) else status_for(exc, "gateway"), path)
    return response.status_code, json.loads(response.body)


def _error(error: PrismError, path: str) -> tuple[int, Any]:
    response = error_response(error, path)
    return response.status_code, json.loads(response.body)
