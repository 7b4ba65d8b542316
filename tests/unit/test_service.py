"""The stage runtime (prism.runtime.service): one handler, served as its plain RPC and inside
its batched twin, with the same per-call behaviour either way, on a real loopback server."""

import asyncio
import contextlib
import secrets

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import REGISTRY

from prism import logs, tracing
from prism.proto.v1 import common_pb2, errors_pb2, inference_pb2, inference_pb2_grpc
from prism.rpc import multiplex
from prism.rpc.channel import channel as open_channel
from prism.rpc.errors import PrismError, invalid
from prism.rpc.server import InFlightLimit, start_server
from prism.runtime import service
from prism.runtime.service import Service


class Handlers:
    """Chat streams the prompt's words back; "fail" fails after the first word, "wait"
    waits for `go`. Each call's request id (as the handler sees it) is kept."""

    def __init__(self, limit: int = 0) -> None:
        self.go = asyncio.Event()
        self.request_ids: list[str] = []
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
            InFlightLimit(limit),
        )
        self.service.stream("Chat", self.chat, timed=True)
        self.service.unary("ListModels", self.list_models)

    async def chat(self, request):
        self.request_ids.append(logs.REQUEST_ID.get())
        for word in request.messages[0].content[0].text.split():
            if word == "wait":
                await self.go.wait()
            yield inference_pb2.ChatResponse(text=word)
            if word == "fail":
                raise invalid("told to fail", "messages", errors_pb2.ERROR_REASON_OVERLOADED)
        yield inference_pb2.ChatResponse(
            finish_reason=common_pb2.FINISH_REASON_STOP, usage=common_pb2.Usage(prompt_tokens=1)
        )

    async def list_models(self, request):
        return inference_pb2.ListModelsResponse(models=[inference_pb2.Model(id="m")])


def chat(text: str) -> inference_pb2.ChatRequest:
    part = inference_pb2.ContentPart(text=text)
    return inference_pb2.ChatRequest(messages=[inference_pb2.ChatMessage(content=[part])])


@contextlib.asynccontextmanager
async def served(handlers: Handlers):
    """The stub and a batched client of a server of `handlers`."""
    server = await start_server("127.0.0.1:0", handlers.service.add_to_server, [])
    channel = open_channel(f"127.0.0.1:{server.port}")
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    batched = multiplex.Client(stub.ChatBatch, inference_pb2.ChatBatchRequest)
    try:
        yield stub, batched
    finally:
        await batched.close()
        await channel.close()
        await server.server.stop(None)


async def words(call) -> tuple[list[str], PrismError | None]:
    """The texts a call streamed, and the error it ended with."""
    texts = []
    try:
        async for reply in call:
            texts.append(reply.text)
    except grpc.aio.AioRpcError as exc:
        return texts, PrismError.from_rpc_error(exc)
    return texts, None


def test_both_forms_stream_the_same_replies_and_end_with_the_same_error():
    async def main():
        handlers = Handlers()
        async with served(handlers) as (stub, batched):
            metadata = ((logs.HEADER, "plain-1"),)
            plain = await words(stub.Chat(chat("a fail b"), metadata=metadata))
            in_batch = await words(batched.call(chat("a fail b"), (("x-request-id", "batch-1"),)))
            fine = await words(batched.call(chat("a b")))
        return handlers, plain, in_batch, fine

    handlers, plain, in_batch, fine = asyncio.run(main())
    for texts, error in (plain, in_batch):
        assert texts == ["a", "fail"]
        assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.message, error.param) == ("told to fail", "messages")
        assert error.reason == errors_pb2.ERROR_REASON_OVERLOADED
    assert fine == (["a", "b", ""], None)
    # Each call runs under its caller's request id, in either form.
    assert handlers.request_ids == ["plain-1", "batch-1", ""]


def test_one_in_flight_limit_counts_the_calls_of_both_forms():
    async def main():
        handlers = Handlers(limit=1)
        async with served(handlers) as (stub, batched):
            waiting = batched.call(chat("wait"))
            while not handlers.request_ids:
                await asyncio.sleep(0.01)
            refused_plain = await words(stub.Chat(chat("a")))
            refused_batched = await words(batched.call(chat("a")))
            # An RPC the limit does not admit is not counted.
            models = await stub.ListModels(inference_pb2.ListModelsRequest())
            handlers.go.set()
            done = await words(waiting)
            after = await words(stub.Chat(chat("a")))
        return refused_plain, refused_batched, models, done, after

    refused_plain, refused_batched, models, done, after = asyncio.run(main())
    for texts, error in (refused_plain, refused_batched):
        assert texts == [] and error is not None
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.metadata["retry_after_s"] == "1"
    assert [m.id for m in models.models] == ["m"]
    assert done == (["wait", ""], None) and after == (["a", ""], None)


def test_a_draining_service_refuses_new_requests_and_is_idle_once_its_own_are_done():
    async def main():
        handlers = Handlers()
        async with served(handlers) as (stub, batched):
            waiting = stub.Chat(chat("wait"))
            while not handlers.request_ids:
                await asyncio.sleep(0.01)
            handlers.service.drain()
            refused_plain = await words(stub.Chat(chat("a")))
            refused_batched = await words(batched.call(chat("a")))
            models = await stub.ListModels(inference_pb2.ListModelsRequest())
            idle = asyncio.ensure_future(handlers.service.idle())
            await asyncio.sleep(0.05)
            busy = not idle.done()
            handlers.go.set()
            done = await words(waiting)
            await asyncio.wait_for(idle, 5)
        return refused_plain, refused_batched, models, busy, done

    refused_plain, refused_batched, models, busy, done = asyncio.run(main())
    for texts, error in (refused_plain, refused_batched):
        assert texts == [] and error is not None
        assert error.code == grpc.StatusCode.UNAVAILABLE, error
    # What it admitted before the drain runs to its end; what it does not admit is served.
    assert [m.id for m in models.models] == ["m"]
    assert busy and done == (["wait", ""], None)


def test_a_draining_service_that_holds_something_is_idle_once_it_is_collected():
    async def main():
        handlers = Handlers()
        held = {"kv"}

        async def holding() -> bool:
            return bool(held)

        handlers.service.hold_while(holding)
        handlers.service.drain()
        idle = asyncio.ensure_future(handlers.service.idle())
        await asyncio.sleep(0.2)
        busy = not idle.done()
        held.clear()
        await asyncio.wait_for(idle, 5)
        return busy

    assert asyncio.run(main())


def count(status: str) -> float:
    return (
        REGISTRY.get_sample_value("prism_requests_total", {"endpoint": "Chat", "status": status})
        or 0.0
    )


def test_a_timed_rpc_counts_calls_by_final_status_and_one_without_handler_is_unimplemented():
    async def main():
        async with served(Handlers()) as (stub, batched):
            await words(stub.Chat(chat("a")))
            await words(batched.call(chat("fail")))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Abort(inference_pb2.AbortRequest(request_id="x"))
        return info.value.code()

    before = count("OK"), count("INVALID_ARGUMENT")
    assert asyncio.run(main()) == grpc.StatusCode.UNIMPLEMENTED
    assert (count("OK") - before[0], count("INVALID_ARGUMENT") - before[1]) == (1, 1)


@pytest.fixture
def spans(monkeypatch):
    """Spans this process ends, as tracing set up would make them."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(service, "tracer", provider.get_tracer("prism"))
    monkeypatch.setattr(tracing, "_enabled", True)
    yield exporter
    provider.shutdown()


def test_each_call_gets_a_server_span_named_for_its_rpc_under_the_callers_trace(spans):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = (("traceparent", f"00-{trace_id}-{parent_id}-01"),)

    async def main():
        async with served(Handlers()) as (stub, batched):
            await words(stub.Chat(chat("a"), metadata=traceparent))
            await words(batched.call(chat("fail"), traceparent))

    asyncio.run(main())
    served_spans = [s for s in spans.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    assert len(served_spans) == 2
    for span, code in zip(
        served_spans, (0, grpc.StatusCode.INVALID_ARGUMENT.value[0]), strict=True
    ):
        assert span.name == "/prism.v1.InferenceService/Chat"
        assert f"{span.context.trace_id:032x}" == trace_id
        assert f"{span.parent.span_id:016x}" == parent_id
        assert span.attributes["rpc.grpc.status_code"] == code
    assert served_spans[0].attributes["gen_ai.usage.input_tokens"] == 1
    assert served_spans[1].status.status_code == trace.StatusCode.ERROR
