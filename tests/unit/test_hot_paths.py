"""The generation endpoints called straight from the ASGI scope (prism.gateway.hot): a POST
to each is answered by the endpoint FastAPI routes it to, without FastAPI's router; other
methods and paths, and errors, are answered as before. Nothing is started: the app's
router finds no processor."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from prism.gateway.app import create_app
from prism.gateway.hot import HotPaths
from prism.gateway.middleware import GENERATIONS
from prism.registry import StaticRegistry
from prism.routing import Router


def _app() -> tuple[FastAPI, list[str]]:
    app, called = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> PlainTextResponse:
        called.append(await request.body())
        return PlainTextResponse("answered", status_code=201)

    @app.get("/v1/chat/completions")
    async def listed() -> PlainTextResponse:
        return PlainTextResponse("routed")

    return app, called


def test_a_post_to_a_hot_path_goes_to_its_endpoint_past_the_router():
    app, called = _app()
    app.add_middleware(HotPaths, routes=app.routes)
    with TestClient(app) as client:
        reply = client.post("/v1/chat/completions", content=b"body")
        assert (reply.status_code, reply.text, called) == (201, "answered", [b"body"])
        assert client.get("/v1/chat/completions").text == "routed"
        assert client.post("/v1/nothing").status_code == 404
    hot = app.middleware_stack
    while not isinstance(hot, HotPaths):
        hot = hot.app
    assert list(hot.endpoints) == ["/v1/chat/completions"]


def test_the_front_calls_every_generation_endpoint_straight_and_answers_as_before():
    app = create_app(Router(StaticRegistry({})))
    with TestClient(app) as client:
        stack = app.middleware_stack
        while not isinstance(stack, HotPaths):
            stack = stack.app
        assert sorted(stack.endpoints) == sorted(GENERATIONS)
        # A bad request and no processor: the same bodies FastAPI's handlers write.
        bad = client.post("/v1/chat/completions", json={"model": "m", "messages": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        assert "x-request-id" in bad.headers
        none = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert none.status_code == 503 and "no processor" in none.json()["error"]["message"]
        assert client.get("/v1/chat/completions").status_code == 405
