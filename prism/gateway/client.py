"""The gateway's one seam to the processor: the calls its doors (REST, KServe) make,
whichever way they travel. Over gRPC to the processors the registry lists, or straight
to the handlers of a processor in this process (no serialization, no sockets); the doors
see only `ProcessorClient`, so that they need not know which."""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate

from prism import tracing
from prism.modes import MeshRole
from prism.proto.v1 import inference_pb2, inference_pb2_grpc
from prism.routing import Router
from prism.rpc.channel import call_metadata, is_serving
from prism.rpc.errors import PrismError, status_for
from prism.runtime.clients import CHAT, COMPLETE, Batched, Peers

# Seconds a processor may take to load an adapter on every engine (or drop it).
_ADAPTER_S = 120.0


class ReplyStream(Protocol):
    """A Chat or Complete call, read as a `grpc.aio.UnaryStreamCall` is (its errors are
    `grpc.aio.AioRpcError`s), with `ready`: the next reply if it is here already."""

    def __aiter__(self) -> AsyncIterator[Any]: ...

    def ready(self) -> Any | None: ...

    def cancel(self) -> bool: ...


class ProcessorClient(Protocol):
    """The calls the gateway makes to the processor's `InferenceService`."""

    def chat(self, request: inference_pb2.ChatRequest) -> ReplyStream: ...

    def complete(self, request: inference_pb2.CompleteRequest) -> ReplyStream: ...

    async def list_models(
        self, timeout: float | None = None
    ) -> inference_pb2.ListModelsResponse: ...

    async def adapter(
        self, request: inference_pb2.LoadAdapterRequest | inference_pb2.UnloadAdapterRequest
    ) -> None: ...

    async def count_tokens(
        self, request: inference_pb2.CountTokensRequest
    ) -> inference_pb2.CountTokensResponse: ...

    async def healthy(self) -> bool: ...

    async def close(self) -> None: ...


class GrpcProcessorClient:
    """The processors `router` finds, over gRPC: Chat and Complete on one batched stream
    per processor (prism.rpc.multiplex)."""

    def __init__(self, router: Router, request_timeout: float = 0):
        self._peers = Peers(router)
        # The deadline of each generation (none when 0): past it, 504 and every stage
        # aborts the request.
        self.timeout = request_timeout or None

    def _pick(self) -> str:
        return self._peers.router.pick(MeshRole.PROCESSOR)

    def chat(self, request: inference_pb2.ChatRequest) -> ReplyStream:
        return self._call(CHAT, request)

    def complete(self, request: inference_pb2.CompleteRequest) -> ReplyStream:
        return self._call(COMPLETE, request)

    def _call(self, method: Batched, request: Any) -> ReplyStream:
        batched = self._peers.batched(self._pick(), method)
        return batched.call(request, call_metadata(), self.timeout)

    async def list_models(self, timeout: float | None = None) -> inference_pb2.ListModelsResponse:
        stub = inference_pb2_grpc.InferenceServiceStub(self._peers.channel(self._pick()))
        return await stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=call_metadata(), timeout=timeout
        )

    async def adapter(
        self, request: inference_pb2.LoadAdapterRequest | inference_pb2.UnloadAdapterRequest
    ) -> None:
        """Loads or unloads an adapter on every processor: each serves what it was told."""
        for address in self._peers.router.registry.endpoints(MeshRole.PROCESSOR):
            stub = inference_pb2_grpc.InferenceServiceStub(self._peers.channel(address))
            call = stub.LoadAdapter if isinstance(request, inference_pb2.LoadAdapterRequest) \
                else stub.UnloadAdapter  # fmt: skip
            await call(request, metadata=call_metadata(), timeout=_ADAPTER_S)

    async def count_tokens(
        self, request: inference_pb2.CountTokensRequest
    ) -> inference_pb2.CountTokensResponse:
        stub = inference_pb2_grpc.InferenceServiceStub(self._peers.channel(self._pick()))
        return await stub.CountTokens(request, metadata=call_metadata(), timeout=self.timeout)

    async def healthy(self) -> bool:
        try:
            channel = self._peers.channel(self._pick())
        except PrismError:
            return False
        return await is_serving(channel, timeout=2.0)

    async def close(self) -> None:
        await self._peers.close()


class InProcessClient:
    """A processor in this process, called through its servicers' RPC handlers by their
    proto names (`Chat`, `Complete`, `ListModels`; the health servicer's `Check`), as
    its gRPC server would call them: the same per-call handling runs, and errors come
    back as the `grpc.aio.AioRpcError`s a gRPC call would raise."""

    def __init__(
        self,
        servicer: inference_pb2_grpc.InferenceServiceServicer,
        health: health_pb2_grpc.HealthServicer,
        request_timeout: float = 0,
    ):
        self.servicer = servicer
        self.health = health
        # As GrpcProcessorClient's: the deadline of each generation (none when 0).
        self.timeout = request_timeout or None

    def chat(self, request: inference_pb2.ChatRequest) -> ReplyStream:
        return LocalCall(self.servicer.Chat, request, self.timeout)

    def complete(self, request: inference_pb2.CompleteRequest) -> ReplyStream:
        return LocalCall(self.servicer.Complete, request, self.timeout)

    async def list_models(self, timeout: float | None = None) -> inference_pb2.ListModelsResponse:
        request = inference_pb2.ListModelsRequest()
        return await _unary(self.servicer.ListModels, request, timeout)

    async def adapter(
        self, request: inference_pb2.LoadAdapterRequest | inference_pb2.UnloadAdapterRequest
    ) -> None:
        load = isinstance(request, inference_pb2.LoadAdapterRequest)
        handler = self.servicer.LoadAdapter if load else self.servicer.UnloadAdapter
        await _unary(handler, request, _ADAPTER_S)

    async def count_tokens(
        self, request: inference_pb2.CountTokensRequest
    ) -> inference_pb2.CountTokensResponse:
        return await _unary(self.servicer.CountTokens, request, self.timeout)

    async def healthy(self) -> bool:
        try:
            reply = await _unary(self.health.Check, health_pb2.HealthCheckRequest(), 2.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        """Nothing to close: the processor's life is its own."""


def _rpc_error(
    code: grpc.StatusCode, details: str, trailing_metadata: tuple = ()
) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata(*trailing_metadata)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def _call_error(error: PrismError) -> grpc.aio.AioRpcError:
    """`error` as a call that ended with it raises it."""
    status = error.to_status()
    return _rpc_error(status.code, status.details, status.trailing_metadata)


def _deadline_exceeded() -> grpc.aio.AioRpcError:
    return _call_error(PrismError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))


class LocalContext:
    """The part of `grpc.aio.ServicerContext` a handler uses: the call's metadata (the
    request id and trace context, as a gRPC call carries them), `write` for a stream's
    replies, and `abort`."""

    def __init__(self, write: Callable[[Any], None] = lambda reply: None) -> None:
        metadata = dict(call_metadata())
        if tracing.enabled():
            propagate.inject(metadata)
        self.metadata = tuple(metadata.items())
        self._write = write
        # What the call ended with, where the handler aborted it.
        self.error: grpc.aio.AioRpcError | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def write(self, reply: Any) -> None:
        self._write(reply)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()
    ) -> None:
        self.error = _rpc_error(code, details, trailing_metadata)
        raise grpc.aio.AbortError()

    async def abort_with_status(self, status: grpc.Status) -> None:
        await self.abort(status.code, status.details, status.trailing_metadata)


async def _handle(handler: Callable, request: Any, context: LocalContext) -> Any:
    """Runs `handler` as gRPC would (a coroutine, or a stream's async generator, whose
    replies go to `context.write`): its reply, or its error as a failed call's."""
    try:
        result = handler(request, context)
        if not inspect.isasyncgen(result):
            return await result
        async for reply in result:
            await context.write(reply)
        return None
    except grpc.aio.AbortError:
        assert context.error is not None
        raise context.error from None
    except Exception as exc:
        raise _call_error(status_for(exc, "processor")) from None


async def _unary(handler: Callable, request: Any, timeout: float | None) -> Any:
    # A task of its own, as a call served by gRPC: what the handler sets in its context
    # (the request id) stays there.
    task = asyncio.create_task(_handle(handler, request, LocalContext()))
    try:
        return await asyncio.wait_for(task, timeout)
    except TimeoutError:
        raise _deadline_exceeded() from None


class LocalCall:
    """A Chat or Complete call on a processor in this process, read as MultiplexCall
    is: the handler runs in a task of its own, and its replies wait here until read."""

    def __init__(self, handler: Callable, request: Any, timeout: float | None) -> None:
        # Replies, then one last item: None (the call completed) or the error to raise.
        self._items: collections.deque = collections.deque()
        self._arrived = asyncio.Event()
        self._ended = False
        self._read_to_end = False
        context = LocalContext(self._reply)
        self._task = asyncio.create_task(self._run(handler, request, context))
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(timeout, self._expire) if timeout else None

    async def _run(self, handler: Callable, request: Any, context: LocalContext) -> None:
        try:
            await _handle(handler, request, context)
        except grpc.aio.AioRpcError as exc:
            self._end(exc)
        else:
            self._end(None)

    def _reply(self, reply: Any) -> None:
        # A handler that is being stopped may write on a moment: the caller is gone.
        if not self._ended:
            self._put(reply)

    def _put(self, item: Any) -> None:
        self._items.append(item)
        self._arrived.set()

    def _end(self, last: BaseException | None) -> bool:
        if self._ended:
            return False
        self._ended = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._put(last)
        return True

    def _expire(self) -> None:
        # As gRPC's own deadline: the handler stops, the caller reads DEADLINE_EXCEEDED.
        if self._end(_deadline_exceeded()):
            self._task.cancel()

    def __aiter__(self) -> LocalCall:
        return self

    async def __anext__(self) -> Any:
        if self._read_to_end:
            raise StopAsyncIteration
        while not self._items:
            self._arrived.clear()
            await self._arrived.wait()
        item = self._items.popleft()
        if item is None or isinstance(item, BaseException):
            self._read_to_end = True
            if item is None:
                raise StopAsyncIteration
            raise item
        return item

    def ready(self) -> Any | None:
        """The next reply if it is here already, else None."""
        if not self._items or self._items[0] is None or isinstance(self._items[0], BaseException):
            return None
        return self._items.popleft()

    def cancel(self) -> bool:
        """Ends the call here and stops its handler; reading on raises CancelledError."""
        if not self._end(asyncio.CancelledError()):
            return False
        self._task.cancel()
        return True
