"""A stage's clients of the stages it calls: one channel per peer, one batched stream per
peer and method (prism.rpc.multiplex), and probes of their health and load for routing.
The processor calls its workers and encoders through one, the gateway its processors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc, load_pb2, load_pb2_grpc
from prism.proto.v1 import inference_pb2, inference_pb2_grpc
from prism.routing import Router
from prism.rpc import multiplex
from prism.rpc.channel import channel as open_channel
from prism.rpc.channel import is_serving


@dataclass(frozen=True)
class Batched:
    """A batched method: the stub that has it, its name and its request message."""

    stub: type
    method: str
    request_type: type
    # How two replies become one, for a caller that reads them late (multiplex.Client).
    merge: Callable[[Any, Any], bool] | None = None


def merge_generated(into: engine_pb2.GenerateResponse, more: engine_pb2.GenerateResponse) -> bool:
    """Adds `more`'s tokens to `into`, unless both mark a position (the first, the last):
    what the prompt was and how the request ended stay messages of their own."""
    if into.WhichOneof("position") and more.WhichOneof("position"):
        return False
    into.token_ids.extend(more.token_ids)
    into.logprobs.extend(more.logprobs)
    if more.HasField("last"):
        into.last.CopyFrom(more.last)
    return True


GENERATE = Batched(
    engine_pb2_grpc.EngineServiceStub,
    "GenerateBatch",
    engine_pb2.GenerateBatchRequest,
    merge_generated,
)
CHAT = Batched(inference_pb2_grpc.InferenceServiceStub, "ChatBatch", inference_pb2.ChatBatchRequest)
COMPLETE = Batched(
    inference_pb2_grpc.InferenceServiceStub, "CompleteBatch", inference_pb2.CompleteBatchRequest
)


class Peers:
    """Channels and batched streams to the replicas `router` routes among."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._batched: dict[tuple[str, Batched], multiplex.Client] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address)
        return self._channels[address]

    def batched(self, address: str, method: Batched) -> multiplex.Client:
        """The one stream that carries every call of `method` to `address`."""
        key = (address, method)
        if key not in self._batched:
            stub = method.stub(self.channel(address))
            self._batched[key] = multiplex.Client(
                getattr(stub, method.method), method.request_type, method.merge
            )
        return self._batched[key]

    async def probe(self, address: str) -> bool:
        """Whether the replica at `address` serves, and its load when routing by load;
        both go to the router."""
        channel = self.channel(address)
        probed_at = time.monotonic()
        serving = await is_serving(channel)
        in_flight = None
        if serving and self.router.policy in ("least-loaded", "kv"):
            try:
                load = await load_pb2_grpc.LoadServiceStub(channel).GetLoad(
                    load_pb2.GetLoadRequest(), timeout=1.0
                )
                in_flight = load.in_flight
            except grpc.aio.AioRpcError:
                pass  # e.g. a sidecar's upstream that balances by itself
        self.router.report(address, serving, in_flight, probed_at)
        return serving

    async def close(self) -> None:
        for batched in self._batched.values():
            await batched.close()
        for channel in self._channels.values():
            await channel.close()
