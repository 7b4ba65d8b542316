"""The gateway calling a processor in its own process (InProcessClient) answers as it does
over gRPC: the same bodies, streams, errors, request ids, deadlines and cancellation."""

import asyncio
import json
import threading

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health, health_pb2
from support.serving import serving
from support.waiting import until

from prism import logs
from prism.gateway.app import create_app
from prism.gateway.client import InProcessClient
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import invalid
from prism.runtime.service import Service

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


class Processor:
    """`InferenceService` from the stage runtime, as the processor serves it: each Chat or
    Complete answers "a", "b", "c"; model "broken" fails as nobody foresaw, "invalid" as
    a bad request, and "slow" holds until cancelled."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.cancelled = threading.Event()
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"], inference_pb2_grpc
        )
        self.service.stage = "processor"
        self.service.stream("Chat", self.replies, timed=True)
        self.service.stream("Complete", self.replies, timed=True)
        self.service.unary("ListModels", self.models)
        # The handlers by their proto names, as its gRPC server gets them.
        self.servicer = self.service.handlers

    async def replies(self, request):
        self.request_ids.append(logs.REQUEST_ID.get())
        if request.model == "broken":
            raise RuntimeError("boom")
        if request.model == "invalid":
            raise invalid("'temperature' is too hot", "temperature")
        if request.model == "slow":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        chat = isinstance(request, inference_pb2.ChatRequest)
        reply = inference_pb2.ChatResponse if chat else inference_pb2.CompleteResponse
        for i, text in enumerate("abc"):
            yield reply(
                model=request.model, text=text, token_ids=[i],
                finish_reason=common_pb2.FINISH_REASON_STOP if i == 2 else 0,
                usage=common_pb2.Usage(prompt_tokens=1, completion_tokens=i + 1,
                                       total_tokens=i + 2),
            )  # fmt: skip

    async def models(self, request):
        model = inference_pb2.Model(id="m", owned_by="prism", created=1, max_model_len=64)
        return inference_pb2.ListModelsResponse(models=[model])


def _stable(reply) -> object:
    """A reply's status and body, less what differs from call to call (ids, times)."""

    def strip(body: dict) -> dict:
        return {k: v for k, v in body.items() if k not in ("id", "created")}

    if reply.headers["content-type"].startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in reply.text.split("\n\n") if e]
        body = [e if e == "[DONE]" else strip(json.loads(e)) for e in events]
    else:
        body = strip(reply.json())
    return reply.status_code, body


def _answers(app) -> list:
    """Every kind of answer: chat and completions, whole and streamed, models, errors."""
    answers = []
    with TestClient(app) as c:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            for model in ("m", "broken", "invalid"):
                for stream in (False, True):
                    sent = {**body, "model": model, "stream": stream}
                    if stream:
                        sent["stream_options"] = {"include_usage": True}
                    reply = c.post(path, json=sent, headers={"x-request-id": "r-1"})
                    answers.append(_stable(reply))
        answers.append(_stable(c.get("/v1/models")))
        answers.append(_stable(c.get("/health")))
    return answers


def test_rest_answers_in_process_as_over_grpc():
    processor = Processor()
    with serving(processor.service.add_to_server, ["prism.v1.InferenceService"]) as address:
        over_grpc = _answers(create_app(Router(StaticRegistry({"processor": [address]}))))
    client = InProcessClient(processor.servicer, health.aio.HealthServicer())
    in_process = _answers(create_app(Router(StaticRegistry({})), processor=client))
    assert in_process == over_grpc
    status, body = in_process[0]
    assert status == 200 and body["choices"][0]["message"]["content"] == "abc"
    assert in_process[2][1]["error"]["message"] == (
        "internal error in the processor: RuntimeError: boom (request r-1)"
    )
    assert in_process[4][0] == 400 and in_process[4][1]["error"]["param"] == "temperature"
    assert in_process[-2][1]["data"][0]["id"] == "m"
    assert set(processor.request_ids) == {"r-1"}


def test_a_deadline_or_a_cancel_stops_the_handler():
    processor = Processor()
    client = InProcessClient(processor.servicer, health.aio.HealthServicer(), request_timeout=0.5)
    app = create_app(Router(StaticRegistry({})), processor=client)
    with TestClient(app) as c:
        reply = c.post("/v1/chat/completions", json={**CHAT, "model": "slow"})
        assert reply.status_code == 504
        assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert processor.cancelled.wait(10)

    async def cancel() -> None:
        processor.cancelled.clear()
        call = InProcessClient(processor.servicer, health.aio.HealthServicer()).complete(
            inference_pb2.CompleteRequest(model="slow")
        )
        assert await until(lambda: len(processor.request_ids) == 2)
        assert call.ready() is None
        assert call.cancel() and not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.__anext__()
        assert await until(processor.cancelled.is_set)

    asyncio.run(cancel())


class Servicer(inference_pb2_grpc.InferenceServiceServicer):
    """Handlers as gRPC's own servicers write them: a stream as an async generator, and
    errors by `context.abort`."""

    async def Chat(self, request, context):
        if not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "'model' is required")
        yield inference_pb2.ChatResponse(text=dict(context.invocation_metadata())[logs.HEADER])


def test_handlers_of_any_servicer_and_health():
    async def main() -> None:
        checks = health.aio.HealthServicer()
        client = InProcessClient(Servicer(), checks)
        token = logs.REQUEST_ID.set("r-2")
        try:
            replies = [r.text async for r in client.chat(inference_pb2.ChatRequest(model="m"))]
            assert replies == ["r-2"]
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for _ in client.chat(inference_pb2.ChatRequest()):
                    pass
        finally:
            logs.REQUEST_ID.reset(token)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert failed.value.details() == "'model' is required"
        assert await client.healthy()
        await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not await client.healthy()

    asyncio.run(main())
