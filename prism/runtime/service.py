"""The stage runtime's serving half: a stage writes one handler per RPC, and `Service`
serves it as its gRPC method and, where the service has a `<Method>Batch` twin, inside
that batched stream too (prism.rpc.multiplex).

Every per-call concern lives here, once for both forms: the caller's request id, the
server span (parented by the caller's trace context), the stage's in-flight limit, the
request metrics of the RPCs clients time, and errors → gRPC status with details.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from opentelemetry import propagate, trace

from prism import logs, telemetry, tracing
from prism.rpc import multiplex
from prism.rpc.errors import PrismError, status_for
from prism.rpc.server import InFlightLimit
from prism.tracing import tracer

log = logging.getLogger(__name__)

# How often a draining service asks whether what it holds was collected.
_HOLD_POLL_S = 0.05

StreamHandler = Callable[[Any], AsyncIterator[Any]]
UnaryHandler = Callable[[Any], Awaitable[Any]]
# Where a call's replies go: the plain call's `context.write`, or the batched stream.
Emit = Callable[[Any], Awaitable[None] | None]


@dataclass(frozen=True)
class _Method:
    path: str  # /prism.stage.v1.EngineService/Generate: the span's name
    name: str
    replies: StreamHandler
    admit: bool
    timed: bool


class Service:
    """One gRPC service of a stage, served from one handler per RPC.

    `stream` and `unary` register a handler; `add_to_server` installs the service on a
    server. Requests the limit admits (`admit`) count against it in both forms; a `timed`
    RPC (one clients wait on: Chat, Complete) is measured as telemetry.RequestTimer does.
    """

    def __init__(
        self,
        descriptor: ServiceDescriptor,
        generated: ModuleType,
        limit: InFlightLimit | None = None,
    ) -> None:
        """`generated`: the service's `*_pb2_grpc` module (its servicer base answers
        UNIMPLEMENTED for RPCs without a handler)."""
        self.descriptor = descriptor
        self.name = descriptor.full_name
        self.limit = limit or InFlightLimit(0)
        # The stage serving it, named in the errors it did not foresee.
        self.stage = ""
        self._add_to_server = getattr(generated, f"add_{descriptor.name}Servicer_to_server")
        self._servicer = getattr(generated, f"{descriptor.name}Servicer")()
        self._batches: list[multiplex.MultiplexServer] = []
        self._on_drain: list[Callable[[], None]] = []
        self._holding: list[Callable[[], Awaitable[bool]]] = []
        self._draining = False
        self._admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def stream(
        self, name: str, handler: StreamHandler, admit: bool = True, timed: bool = False
    ) -> None:
        """Serves `handler` (request → replies) as the server-streaming RPC `name` and, if
        the service has one, inside the batched `<name>Batch`."""
        method = _Method(f"/{self.name}/{name}", name, handler, admit, timed)

        async def plain(request: Any, context: grpc.aio.ServicerContext) -> None:
            error = await self._run(method, request, _metadata(context), context.write)
            if error is not None:
                await context.abort_with_status(error.to_status())

        setattr(self._servicer, name, plain)
        batched = self.descriptor.methods_by_name.get(f"{name}Batch")
        if batched is None:
            return
        response_type = message_factory.GetMessageClass(batched.output_type)
        event_type = message_factory.GetMessageClass(
            batched.output_type.fields_by_name["events"].message_type
        )

        async def run(request: Any, metadata: dict[str, str], emit: Emit) -> Any:
            return await self._run(method, request, metadata, emit)

        batches = multiplex.MultiplexServer(run, response_type, event_type)
        self._batches.append(batches)

        async def serve_batches(requests: AsyncIterator, context: grpc.aio.ServicerContext):
            async for batch in batches.serve(requests):
                yield batch

        setattr(self._servicer, f"{name}Batch", serve_batches)

    def unary(self, name: str, handler: UnaryHandler, admit: bool = False) -> None:
        """Serves `handler` (request → reply) as the unary RPC `name`."""

        async def one(request: Any) -> AsyncIterator[Any]:
            yield await handler(request)

        method = _Method(f"/{self.name}/{name}", name, one, admit, False)

        async def plain(request: Any, context: grpc.aio.ServicerContext) -> Any:
            replies: list[Any] = []
            error = await self._run(method, request, _metadata(context), replies.append)
            if error is not None:
                await context.abort_with_status(error.to_status())
            return replies[0]

        setattr(self._servicer, name, plain)

    @property
    def handlers(self) -> Any:
        """The servicer a gRPC server calls: one method per RPC, by its proto name."""
        return self._servicer

    def add_to_server(self, server: grpc.aio.Server) -> None:
        self._add_to_server(self._servicer, server)

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Runs `callback` on drain too: a service of streams without end ends them."""
        self._on_drain.append(callback)

    def drain(self) -> None:
        """New requests are refused (UNAVAILABLE, so callers go elsewhere); batched streams
        end once their calls are done."""
        self._draining = True
        for batches in self._batches:
            batches.drain()
        for callback in self._on_drain:
            callback()

    def hold_while(self, holding: Callable[[], Awaitable[bool]]) -> None:
        """Draining waits until `holding()` is false too: what finished calls left for
        another stage to collect (a prefill's KV cache, until a decode reads it)."""
        self._holding.append(holding)

    async def idle(self) -> None:
        """Returns once no request it admitted is running, and nothing is held."""
        await self._idle.wait()
        for holding in self._holding:
            while await holding():
                await asyncio.sleep(_HOLD_POLL_S)

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        # Refused here, not by gRPC's own shutdown: a call that reaches a server whose
        # shutdown has begun is cancelled, which tells its caller nothing.
        if self._draining:
            raise PrismError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        with self.limit.admit():
            self._admitted += 1
            self._idle.clear()
            try:
                yield
            finally:
                self._admitted -= 1
                if not self._admitted:
                    self._idle.set()

    async def _run(
        self, method: _Method, request: Any, metadata: Mapping[str, str], emit: Emit
    ) -> PrismError | None:
        """Runs one call of `method`, its replies to `emit`; the error it ended with, or
        None. A cancelled call raises CancelledError: its caller expects nothing more."""
        if logs.HEADER in metadata:
            logs.REQUEST_ID.set(metadata[logs.HEADER])
        parent = propagate.extract(metadata) if tracing.enabled() else None
        timer = telemetry.RequestTimer(method.name) if method.timed else None
        status = grpc.StatusCode.OK
        with tracer.start_as_current_span(
            method.path,
            context=parent,
            kind=trace.SpanKind.SERVER,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                with self._admit() if method.admit else contextlib.nullcontext():
                    # Closed when the call ends, also where a cancel lands outside the
                    # handler (a plain call's write): what it holds is freed now, not when
                    # it is collected.
                    async with contextlib.aclosing(method.replies(request)) as replies:
                        async for reply in replies:
                            if timer is not None:
                                timer.reply(reply)
                                _describe_usage(span, reply)
                            sent = emit(reply)
                            if sent is not None:
                                await sent
                return None
            except asyncio.CancelledError:
                status = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                error = status_for(exc, self.stage)
                status = error.code
                span.set_status(trace.Status(trace.StatusCode.ERROR, error.message))
                return error
            finally:
                span.set_attribute("rpc.grpc.status_code", status.value[0])
                if timer is not None:
                    timer.finish(status == grpc.StatusCode.OK)
                    telemetry.REQUESTS.labels(method.name, status.name).inc()
                    log.info("%s %s: %s after %.3f s", method.name, logs.REQUEST_ID.get(),
                             status.name, time.perf_counter() - timer.start)  # fmt: skip


def _describe_usage(span: trace.Span, reply: Any) -> None:
    if reply.HasField("usage"):
        span.set_attributes({
            "gen_ai.usage.input_tokens": reply.usage.prompt_tokens,
            "gen_ai.usage.output_tokens": reply.usage.completion_tokens,
        })  # fmt: skip


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    pairs = context.invocation_metadata() or ()
    return {key: value for key, value in pairs if isinstance(value, str)}
