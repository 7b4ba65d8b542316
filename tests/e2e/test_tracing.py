"""One trace per request across every stage of an E/P/D mesh of real processes, exported
over OTLP/gRPC to a receiver this test runs; and the request id in every stage's JSON log
lines."""

from __future__ import annotations

import json
import secrets
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from support.content import data_url, png, user
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.proto.kserve import grpc_service_pb2 as kserve_pb2
from prism.proto.kserve import grpc_service_pb2_grpc as kserve_pb2_grpc
from prism.runtime.ports import free_port

STAGES = {"prism-gateway", "prism-processor", "prism-encoder", "prism-prefill", "prism-decode"}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps (service name, span) of every export."""

    def __init__(self):
        self.spans: list[tuple[str, Span]] = []

    def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append((attributes["service.name"], span))
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, Span]]:
        return [(service, span) for service, span in self.spans if span.trace_id == trace_id]


def attributes(span: Span) -> dict:
    values = {}
    for a in span.attributes:
        kind = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, kind) if kind else None
    return values


@pytest.fixture
def receiver(monkeypatch):
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    # The stages read the standard variables; the launcher passes them on.
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    yield receiver
    server.stop(None)


def test_one_trace_spans_every_stage_of_e_p_d(models, tmp_path, receiver):
    kserve_port = free_port()
    mesh = start_mesh("llava", "e/p/d", models["llava"], tmp_path, log_level="info",
                      log_format="json", kserve_grpc_port=kserve_port)  # fmt: skip
    try:
        trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
        headers = {
            "traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01",
            "x-request-id": "trace-test-1",
        }
        body = {
            "model": mesh.model,
            "messages": user("Describe it.", {"type": "image_url",
                                              "image_url": {"url": data_url(png(11))}}),
            "max_tokens": 6,
            "temperature": 0,
        }  # fmt: skip
        reply = httpx.post(f"{mesh.base_url}/chat/completions", json=body, headers=headers,
                           timeout=120)  # fmt: skip
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-request-id"] == "trace-test-1"
        answer = reply.json()

        def services() -> set[str]:
            return {service for service, _ in receiver.trace(trace_id)}

        def roots() -> list[tuple[str, bytes]]:
            """(service, parent id) of the spans whose parent is not in the trace."""
            spans = receiver.trace(trace_id)
            ids = {span.span_id for _, span in spans}
            return [(s, span.parent_span_id) for s, span in spans if span.parent_span_id not in ids]

        def whole() -> bool:
            return services() >= STAGES and roots() == [("prism-gateway", parent_id)]

        # Parent links: once every stage has exported its spans, the gateway's hangs off
        # the caller's traceparent and every other span off a span of this trace.
        assert wait_for(whole, timeout=30), (services(), roots())
        spans = receiver.trace(trace_id)
        (root,) = [span for _, span in spans if span.parent_span_id == parent_id]
        assert root.kind == Span.SPAN_KIND_SERVER
        by_service: dict[str, list[Span]] = {}
        for service, span in spans:
            by_service.setdefault(service, []).append(span)
        for service in STAGES - {"prism-gateway"}:
            assert any(s.kind == Span.SPAN_KIND_SERVER for s in by_service[service]), service
        names = {span.name for _, span in spans}
        assert {"image.load", "vision.encode", "nixl.read", "prefill", "decode"} <= names
        assert "/prism.v1.InferenceService/Chat" in names
        assert "/prism.stage.v1.EncoderService/Encode" in names
        # The processor's span describes the request; each stage's knows its request id.
        (chat,) = [s for s in by_service["prism-processor"]
                   if s.name == "/prism.v1.InferenceService/Chat"
                   and s.kind == Span.SPAN_KIND_SERVER]  # fmt: skip
        described = attributes(chat)
        assert described["prism.mode"] == "e/p/d"
        assert described["gen_ai.request.model"] == mesh.model
        assert described["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
        assert described["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
        for service, name in (("prism-encoder", "vision.encode"), ("prism-prefill", "prefill"),
                              ("prism-decode", "decode")):  # fmt: skip
            (span,) = [s for s in by_service[service] if s.name == name]
            assert attributes(span)["prism.request_id"] == "trace-test-1"
        (read,) = [s for s in by_service["prism-prefill"] if s.name == "nixl.read"]
        assert attributes(read)["prism.transfer.bytes"] > 0
        assert attributes(read)["prism.nixl.peer"].startswith("prism-")

        # A KServe request is traced as a REST one: from the caller's context on.
        kserve_trace, kserve_parent = secrets.token_bytes(16), secrets.token_bytes(8)
        infer = kserve_pb2.ModelInferRequest(model_name=mesh.model, inputs=[
            kserve_pb2.ModelInferRequest.InferInputTensor(
                name="text_input", datatype="BYTES", shape=[1],
                contents=kserve_pb2.InferTensorContents(bytes_contents=[b"Once upon a time"]),
            )
        ])  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{kserve_port}") as channel:
            kserve_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                infer, timeout=120,
                metadata=[("traceparent", f"00-{kserve_trace.hex()}-{kserve_parent.hex()}-01")],
            )  # fmt: skip

        def kserve_spans() -> dict[str, Span]:
            return {span.name: span for _, span in receiver.trace(kserve_trace)}

        infer_span, complete_span = (
            "/inference.GRPCInferenceService/ModelInfer", "/prism.v1.InferenceService/Complete"
        )  # fmt: skip
        assert wait_for(lambda: {infer_span, complete_span} <= set(kserve_spans()), timeout=30)
        traced = kserve_spans()
        assert traced[infer_span].parent_span_id == kserve_parent
        assert traced[infer_span].kind == Span.SPAN_KIND_SERVER
    finally:
        mesh.stop()
    # Each stage's log lines about this request carry its request id.
    lines = []
    for line in mesh.log_path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if answer["id"] in entry["message"]:
                lines.append(entry)
    assert {entry["request_id"] for entry in lines} == {"trace-test-1"}
    loggers = sorted(entry["logger"] for entry in lines)
    worker = "prism.services.worker.servicer"
    assert loggers == ["prism.services.encoder", "prism.services.processor", worker, worker]
