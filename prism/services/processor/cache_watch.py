"""What each worker's prefix cache holds, followed for `kv` routing: one
`KvEventsService.Subscribe` stream per replica of the role that computes prompts, over
the channel the processor already has to it (through a sidecar too), into the router's
index. A replica whose stream ends is dropped from the index until it subscribes again
and sends a snapshot; one that leaves the registry is dropped for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from prism import telemetry
from prism.proto.stage.v1 import kv_events_pb2, kv_events_pb2_grpc
from prism.runtime.clients import Peers

log = logging.getLogger(__name__)

# Wait before subscribing again to a replica whose stream ended.
_RETRY_S = 1.0


class CacheWatch:
    def __init__(self, peers: Peers, role: str) -> None:
        self.peers = peers
        self.router = peers.router
        self.role = role
        self._follows: dict[str, asyncio.Task] = {}

    def refresh(self) -> None:
        """Follows every replica the registry lists now, and no other."""
        listed = set(self.router.registry.endpoints(self.role))
        for address in listed - self._follows.keys():
            self._follows[address] = asyncio.create_task(self._follow(address))
        for address in self._follows.keys() - listed:
            self._follows.pop(address).cancel()
            self._forget(address)

    async def close(self) -> None:
        for task in self._follows.values():
            task.cancel()
        for task in self._follows.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._follows.clear()

    async def _follow(self, address: str) -> None:
        stub = kv_events_pb2_grpc.KvEventsServiceStub(self.peers.channel(address))
        while True:
            try:
                async for message in stub.Subscribe(kv_events_pb2.SubscribeRequest()):
                    self._receive(address, message)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("%s serves no KV events: routed by load alone", address)
                    self._forget(address)
                    return
            self._forget(address)
            await asyncio.sleep(_RETRY_S)

    def _receive(self, address: str, message: kv_events_pb2.SubscribeResponse) -> None:
        if message.snapshot:
            telemetry.KV_SNAPSHOTS.labels(address).inc()
        if message.block_size:
            self.router.block_size = message.block_size
        self.router.index.receive(address, message.snapshot, message.stored, message.removed)
        telemetry.KV_EVENTS_RECEIVED.labels(address).inc(len(message.stored) + len(message.removed))
        telemetry.KV_INDEX_BLOCKS.labels(address).set(self.router.index.size(address))

    def _forget(self, address: str) -> None:
        self.router.index.drop(address)
        telemetry.KV_INDEX_BLOCKS.labels(address).set(0)
