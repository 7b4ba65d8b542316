"""The gateway alone: OpenAI error JSON when no processor can take the request."""

import asyncio
import contextlib
import time
from concurrent import futures

from conftest import serving
from fastapi.testclient import TestClient

from prism.gateway.app import create_app
from prism.ports import free_port
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.runtime.service import Service
from prism.v1 import common_pb2, inference_pb2, inference_pb2_grpc

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def client(peers: dict[str, list[str]]) -> TestClient:
    return TestClient(create_app(Router(StaticRegistry(peers))))


def test_unreachable_processor_is_503():
    with client({"processor": [f"127.0.0.1:{free_port()}"]}) as c:
        for stream in (False, True):
            reply = c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert reply.status_code == 503
            assert reply.json()["error"]["type"] == "server_error"
        # Nothing listed while nothing can serve it.
        assert c.get("/v1/models").json() == {"object": "list", "data": []}
        assert c.get("/health").status_code == 503


def test_no_processor_registered_is_503():
    with client({}) as c:
        reply = c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert reply.status_code == 503
        assert "no processor" in reply.json()["error"]["message"]
        assert c.get("/v1/models").json() == {"object": "list", "data": []}


def test_request_errors_are_caught_before_any_call():
    with client({}) as c:
        reply = c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "temperature"
        reply = c.get("/v1/nothing-here")
        assert reply.status_code == 404 and "error" in reply.json()


def test_api_key_guards_the_api_but_not_health_or_metrics():
    app = create_app(Router(StaticRegistry({})), api_key="s3cret")
    with TestClient(app) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = c.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert reply.status_code == 401 and reply.headers["WWW-Authenticate"] == "Bearer"
            error = reply.json()["error"]
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert c.get("/v1/models").status_code == 401
        # With the key the request goes on (and finds no processor).
        reply = c.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer s3cret"}
        )
        assert reply.status_code == 503
        assert c.get("/health").status_code == 503
        assert c.get("/metrics").status_code == 200


class SlowProcessor:
    """Answers each Chat with one token after `delay` seconds."""

    def __init__(self, delay: float):
        self.delay = delay
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
        )
        self.service.stream("Chat", self.replies)

    async def replies(self, request):
        await asyncio.sleep(self.delay)
        yield inference_pb2.ChatResponse(
            text="ok", token_ids=[1], finish_reason=common_pb2.FINISH_REASON_STOP,
            usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        )  # fmt: skip


def slow_processor(delay: float) -> contextlib.AbstractContextManager[str]:
    return serving(
        SlowProcessor(delay).service.add_to_server,
        ["prism.v1.InferenceService"],
    )


def test_past_the_bound_generations_get_429_with_retry_after():
    with slow_processor(delay=1.5) as address:
        app = create_app(Router(StaticRegistry({"processor": [address]})), max_in_flight=1)
        with TestClient(app) as c, futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(c.post, "/v1/chat/completions", json=CHAT)
            time.sleep(0.5)
            second = c.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1"
            assert second.json()["error"]["type"] == "rate_limit_error"
            assert first.result().status_code == 200
            # The slot is free again.
            assert c.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_request_timeout_is_504():
    with slow_processor(delay=3) as address:
        app = create_app(Router(StaticRegistry({"processor": [address]})), request_timeout=0.5)
        with TestClient(app) as c:
            reply = c.post("/v1/chat/completions", json=CHAT)
            assert reply.status_code == 504
            assert reply.json()["error"]["code"] == "deadline_exceeded"
