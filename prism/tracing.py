"""OpenTelemetry tracing: one trace per request across every stage.

Off unless the standard variables ask for it: `OTEL_TRACES_EXPORTER` (otlp, console) or
an OTLP endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`;
`OTEL_EXPORTER_OTLP_PROTOCOL` grpc or http/protobuf). When on, gRPC channels get
OpenTelemetry's interceptors, which carry the W3C trace context in gRPC metadata (servers
read it in the stage runtime, prism.runtime.service, which makes each call's span), and
the gateway's FastAPI app is instrumented (an incoming `traceparent` is honoured). When
off, nothing is installed and `tracer` hands out no-op spans.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from opentelemetry import trace

tracer = trace.get_tracer("prism")
_enabled = False
# The service this process's provider names, and the providers of the other stages it
# serves as well (`face`).
_service = ""
_faces: dict[str, trace.TracerProvider] = {}


def _wanted() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "")
    if exporters:
        return exporters != "none"
    return any(
        os.environ.get(name)
        for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def _exporters() -> list:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    exporters = []
    for name in (os.environ.get("OTEL_TRACES_EXPORTER") or "otlp").split(","):
        name = name.strip()
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"
            )
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            # Endpoint, headers, timeout and TLS come from the OTEL_EXPORTER_OTLP_* variables.
            exporters.append(OTLPSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}")
    return exporters


def setup(service: str) -> bool:
    """Installs the tracer provider of this process, as `prism-<service>`, if tracing is
    asked for. Returns whether it is on."""
    global _enabled, _service
    if _enabled or not _wanted():
        return _enabled
    trace.set_tracer_provider(_provider(service))
    _enabled, _service = True, service
    return True


def _provider(service: str) -> trace.TracerProvider:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": f"prism-{service}", "service.namespace": "prism"})
    provider = TracerProvider(resource=resource)
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def face(service: str) -> trace.TracerProvider | None:
    """The provider for the spans of `service` where this process serves it too (a front
    opens the gateway's doors): a provider of its own, so that its spans are named as
    they are where it runs apart. None: the process's own (or tracing is off)."""
    if not _enabled or service == _service:
        return None
    if service not in _faces:
        _faces[service] = _provider(service)
    return _faces[service]


def enabled() -> bool:
    return _enabled


def _traced_calls() -> Callable[[object], bool]:
    from opentelemetry.instrumentation.grpc import filters

    # Health and load probes run every second for every replica: not request work. A
    # batched stream lives as long as its peer; each call on it has a span of its own.
    return filters.negate(
        filters.any_of(
            filters.health_check(),
            filters.service_name("prism.stage.v1.LoadService"),
            *(filters.method_name(m) for m in ("GenerateBatch", "ChatBatch", "CompleteBatch")),
        )
    )


def client_interceptors() -> list:
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_traced_calls()))


def server_interceptors(service: str) -> list:
    """Server spans for a front door's gRPC calls, as `service`'s, parented by the
    caller's context (the stages make their own, in prism.runtime.service)."""
    if not _enabled:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=face(service), filter_=_traced_calls())]


def instrument_app(app: object, service: str) -> None:
    """Spans for HTTP requests, as `service`'s, parented by an incoming `traceparent`."""
    if _enabled:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(
            app, excluded_urls="health,metrics", tracer_provider=face(service)
        )
