"""The gateway alone: OpenAI error JSON when no processor can take the request."""

import asyncio
import contextlib
import json
import threading
from concurrent import futures

from fastapi.testclient import TestClient
from support.serving import serving
from support.waiting import until

from prism.gateway.app import create_app
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.runtime.ports import free_port
from prism.runtime.service import Service

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
    """Answers each Chat with one token after `delay` seconds, or sooner once `release` is
    set; sets `arrived` as each Chat comes in."""

    def __init__(self, delay: float):
        self.delay = delay
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
        )
        self.service.stream("Chat", self.replies)

    async def replies(self, request):
        self.arrived.set()
        await until(self.release.is_set, self.delay)
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
    processor = SlowProcessor(delay=30)
    with serving(processor.service.add_to_server, ["prism.v1.InferenceService"]) as address:
        app = create_app(Router(StaticRegistry({"processor": [address]})), max_in_flight=1)
        with TestClient(app) as c, futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(c.post, "/v1/chat/completions", json=CHAT)
            # The processor has it, so it holds the gateway's one slot until released.
            assert processor.arrived.wait(15)
            second = c.post("/v1/chat/completions", json=CHAT)
            assert second.status_code == 429 and second.headers["Retry-After"] == "1"
            assert second.json()["error"]["type"] == "rate_limit_error"
            # A response is a generation too.
            third = c.post("/v1/responses", json={"model": "m", "input": "hi"})
            assert third.status_code == 429
            processor.release.set()
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


class BurstProcessor:
    """Answers each Chat with three messages at once, then holds the stream open until
    the call is cancelled, which it records."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
        )
        self.service.stream("Chat", self.replies)

    async def replies(self, request):
        for text in ("a", "b", "c"):
            yield inference_pb2.ChatResponse(text=text, token_ids=[1])
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        yield inference_pb2.ChatResponse()  # unreachable: the client goes away first


def test_ready_events_go_out_in_one_write_and_a_client_that_leaves_cancels_its_call():
    processor = BurstProcessor()
    with serving(processor.service.add_to_server, ["prism.v1.InferenceService"]) as address:
        app = create_app(Router(StaticRegistry({"processor": [address]})))
        writes: list[bytes] = []
        left = asyncio.Event()

        async def main() -> None:
            body = json.dumps({**CHAT, "stream": True}).encode()
            incoming = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:
                if incoming:
                    return incoming.pop()
                await left.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.body" and message["body"]:
                    writes.append(message["body"])
                    left.set()  # the client leaves once it has read the first write

            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                     "headers": [(b"content-type", b"application/json")], "query_string": b"",
                     "http_version": "1.1", "scheme": "http", "root_path": "",
                     "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1234)}  # fmt: skip
            async with app.router.lifespan_context(app):
                # Returns, quietly, once the client is gone.
                await asyncio.wait_for(app(scope, receive, send), 10)

        asyncio.run(main())
        assert len(writes) == 1
        events = [json.loads(e[len(b"data: ") :]) for e in writes[0].split(b"\n\n") if e]
        assert [e["choices"][0]["delta"]["content"] for e in events] == ["a", "b", "c"]
        assert processor.cancelled.wait(10)


class BrokenProcessor:
    """A processor whose Chat fails in a way nobody foresaw."""

    def __init__(self) -> None:
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
        )
        self.service.stage = "processor"
        self.service.stream("Chat", self.replies)

    async def replies(self, request):
        raise RuntimeError("boom")
        yield


def test_a_server_error_names_the_stage_its_cause_and_the_request(monkeypatch):
    processor = BrokenProcessor()
    with (
        serving(processor.service.add_to_server, ["prism.v1.InferenceService"]) as address,
        client({"processor": [address]}) as c,
    ):
        for stream in (False, True):
            reply = c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
            assert reply.status_code == 500
            error = reply.json()["error"]
            request_id = reply.headers["x-request-id"]
            assert error["type"] == "server_error" and error["code"] == "internal"
            assert error["message"] == (
                f"internal error in the processor: RuntimeError: boom (request {request_id})"
            )
        # The gateway's own unforeseen errors too: an OpenAI body, never a bare 500.
        monkeypatch.setattr(
            "prism.gateway.openai.chat.chat_request",
            lambda *args, **kwargs: (_ for _ in ()).throw(KeyError("oops")),
        )
        reply = c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "r-1"})
        assert reply.status_code == 500
        assert reply.json()["error"]["message"] == (
            "internal error in the gateway: KeyError: 'oops' (request r-1)"
        )
