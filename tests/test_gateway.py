"""The gateway alone: OpenAI error JSON when no processor can take the request."""

from fastapi.testclient import TestClient

from prism.gateway.app import create_app
from prism.launcher import free_port
from prism.registry import StaticRegistry
from prism.routing import Router

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def client(peers: dict[str, list[str]]) -> TestClient:
    return TestClient(create_app(Router(StaticRegistry(peers))))


def test_unreachable_processor_is_503():
    with client({"processor": [f"127.0.0.1:{free_port()}"]}) as c:
        for stream in (False, True):
            reply = c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert reply.status_code == 503
            assert reply.json()["error"]["type"] == "server_error"
        assert c.get("/v1/models").status_code == 503
        assert c.get("/health").status_code == 503


def test_no_processor_registered_is_503():
    with client({}) as c:
        reply = c.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert reply.status_code == 503
        assert "no processor" in reply.json()["error"]["message"]


def test_request_errors_are_caught_before_any_call():
    with client({}) as c:
        reply = c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"})
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "temperature"
        reply = c.get("/v1/nothing-here")
        assert reply.status_code == 404 and "error" in reply.json()
