"""The generation endpoints called straight from the ASGI scope.

A POST to chat completions, completions or Responses is what a front serves most; FastAPI
would route it through its route matching, its request wrapper and exception layers before
the endpoint runs, once per request, at a cost measured in bench/notes/scale.md. Here the
endpoint that FastAPI routes that path to is called with the request and its response
sent, and nothing else changes: any other method or path goes on to FastAPI, and an error
raised goes out to the front door (prism.gateway.middleware.FrontDoor), which answers it
with the body FastAPI's handler would have written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from prism.gateway.middleware import GENERATIONS

Endpoint = Callable[[Request], Awaitable[Response]]


class HotPaths:
    """ASGI middleware in front of FastAPI's router: POSTs to the generation paths go to
    the endpoints that `routes` (the app's, read once the app is built) give them."""

    def __init__(self, app: Any, routes: Sequence[Any]) -> None:
        self.app = app
        self.endpoints: dict[str, Endpoint] = {
            route.path: route.endpoint
            for route in routes
            if isinstance(route, APIRoute)
            and route.path in GENERATIONS
            and route.methods == {"POST"}
        }

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
