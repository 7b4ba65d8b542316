"""`KvEventsService` as a worker serves it, whatever feeds it: a snapshot of every block
key held, then each change, to every subscriber. vLLM's events (prism.engine.kv_events)
and the simulated engine (prism.services.sim) both publish here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

from prism.proto.stage.v1 import kv_events_pb2, kv_events_pb2_grpc
from prism.runtime.service import Service

# Changes a subscriber may fall behind by before it is sent a snapshot instead.
_BACKLOG = 1024


class KvPublisher:
    def __init__(self, held: Callable[[], Iterable[int]], block_size: Callable[[], int]) -> None:
        """`held`: every key the engine holds now; `block_size`: its tokens per block."""
        self._held = held
        self._block_size = block_size
        self._subscribers: set[asyncio.Queue[kv_events_pb2.SubscribeResponse | None]] = set()
        self.service = Service(
            kv_events_pb2.DESCRIPTOR.services_by_name["KvEventsService"], kv_events_pb2_grpc
        )
        self.service.stream("Subscribe", self.subscribe, admit=False)
        self.service.on_drain(self.close)
        self._closed = False

    async def subscribe(
        self, request: kv_events_pb2.SubscribeRequest
    ) -> AsyncIterator[kv_events_pb2.SubscribeResponse]:
        queue: asyncio.Queue[kv_events_pb2.SubscribeResponse | None] = asyncio.Queue(_BACKLOG)
        self._subscribers.add(queue)
        try:
            change: kv_events_pb2.SubscribeResponse | None = None
            while not self._closed:
                # None: the first message, or the subscriber fell behind.
                yield change or self.snapshot()
                change = await queue.get()
        finally:
            self._subscribers.discard(queue)

    def close(self) -> None:
        """Ends every subscription: the worker drains."""
        self._closed = True
        for queue in self._subscribers:
            _wake(queue)

    def snapshot(self) -> kv_events_pb2.SubscribeResponse:
        return kv_events_pb2.SubscribeResponse(
            snapshot=True, stored=self._held(), block_size=self._block_size()
        )

    def send(self, change: kv_events_pb2.SubscribeResponse) -> None:
        """One change (or, with `snapshot` set, everything held) to every subscriber."""
        change.block_size = self._block_size()
        for queue in self._subscribers:
            try:
                queue.put_nowait(change)
            except asyncio.QueueFull:
                _wake(queue)

    def publish(self, stored: Iterable[int] = (), removed: Iterable[int] = ()) -> None:
        """Keys the engine evicted, then keys it stored."""
        change = kv_events_pb2.SubscribeResponse(stored=stored, removed=removed)
        if change.stored or change.removed:
            self.send(change)


def _wake(queue: asyncio.Queue[kv_events_pb2.SubscribeResponse | None]) -> None:
    """Leaves the subscription nothing but a snapshot (or its end) to send next."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)
