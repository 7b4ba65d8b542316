"""The gateway's one seam to the processor: the calls its doors (REST, KServe) make,
whichever way they travel. Today over gRPC to the processors the registry lists; the
doors see only `ProcessorClient`, so that they need not know."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from prism import rpc
from prism.modes import MeshRole
from prism.routing import Router
from prism.rpc import PrismError
from prism.runtime.clients import CHAT, COMPLETE, Batched, Peers
from prism.v1 import inference_pb2, inference_pb2_grpc


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
        return batched.call(request, rpc.call_metadata(), self.timeout)

    async def list_models(self, timeout: float | None = None) -> inference_pb2.ListModelsResponse:
        stub = inference_pb2_grpc.InferenceServiceStub(self._peers.channel(self._pick()))
        return await stub.ListModels(
            inference_pb2.ListModelsRequest(), metadata=rpc.call_metadata(), timeout=timeout
        )

    async def healthy(self) -> bool:
        try:
            channel = self._peers.channel(self._pick())
        except PrismError:
            return False
        return await rpc.is_serving(channel, timeout=2.0)

    async def close(self) -> None:
        await self._peers.close()
