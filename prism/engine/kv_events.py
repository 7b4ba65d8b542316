"""A worker's prefix cache, as processors route by it: vLLM's KV events, read from the
engine core over a local ZMQ socket (ipc: no port), keyed (prism.kv_index.EngineBlocks)
and handed on as `KvEventsService.Subscribe`'s messages to whoever serves that
(`KvEvents.send`: the worker's publisher, prism.services.worker.kv_publisher).

Events carry sequence numbers. A gap is filled from the engine's replay buffer; past what
that holds, the keys held would be wrong, so the engine's prefix cache is reset: vLLM then
reports it cleared, and routing starts again from a true empty cache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.v1.engine.async_llm import AsyncLLM

from prism import telemetry
from prism.kv_index import EngineBlocks
from prism.proto.stage.v1 import kv_events_pb2
from prism.rpc.server import Server

log = logging.getLogger(__name__)

_REPLAY_TIMEOUT_MS = 2000
# Tiers of KV events that vLLM's prefix cache serves from (None: not said).
_SERVED_MEDIA = (None, "GPU")


class KvEvents:
    def __init__(self, directory: Path) -> None:
        """`directory`: where the engine's sockets go, the worker's own. Set `engine` once
        it runs with `config()`, and `send` to what takes each change."""
        self.endpoint = f"ipc://{directory}/kv-events"
        self.replay_endpoint = f"ipc://{directory}/kv-replay"
        self.blocks = EngineBlocks()
        self.engine: AsyncLLM | None = None
        self._next = 0
        self._context = zmq.asyncio.Context()
        self.send: Callable[[kv_events_pb2.SubscribeResponse], None] = lambda change: None

    def config(self) -> KVEventsConfig:
        """The engine's side: publish to this worker's sockets."""
        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )

    @property
    def block_size(self) -> int:
        return self.engine.vllm_config.cache_config.block_size if self.engine else 0

    def apply(self, events: list[KVCacheEvent]) -> None:
        """One batch of the engine's events, sent on to subscribers."""
        for change in changes(self.blocks, events):
            self.send(change)
        telemetry.KV_BLOCKS_HELD.set(len(self.blocks))

    async def read(self, server: Server) -> None:
        """Reads the engine's events for as long as the worker serves (a stage task)."""
        events = self._context.socket(zmq.SUB)
        events.setsockopt(zmq.SUBSCRIBE, b"")
        events.connect(self.endpoint)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        try:
            while True:
                _, number, payload = await events.recv_multipart()
                sequence = int.from_bytes(number, "big")
                if sequence > self._next and not await self._replay(sequence, decoder):
                    await self._resynchronize(sequence)
                if sequence >= self._next:
                    self.apply(decoder.decode(payload).events)
                    self._next = sequence + 1
        finally:
            events.close(linger=0)

    async def _replay(self, until: int, decoder: msgspec.msgpack.Decoder) -> bool:
        """Applies the batches before `until` that were missed, from the engine's replay
        buffer; False if it no longer holds them all."""
        replay = self._context.socket(zmq.DEALER)
        replay.setsockopt(zmq.RCVTIMEO, _REPLAY_TIMEOUT_MS)
        replay.connect(self.replay_endpoint)
        try:
            await replay.send_multipart((b"", self._next.to_bytes(8, "big")))
            while True:
                _, _, number, payload = await replay.recv_multipart()
                if number == ZmqEventPublisher.END_SEQ:
                    return self._next >= until
                sequence = int.from_bytes(number, "big")
                if sequence != self._next:
                    return False
                if sequence < until:
                    self.apply(decoder.decode(payload).events)
                    self._next = sequence + 1
        except zmq.Again:
            return False
        finally:
            replay.close(linger=0)

    async def _resynchronize(self, sequence: int) -> None:
        log.warning(
            "KV events %d to %d were lost; resetting the prefix cache to know it again",
            self._next,
            sequence - 1,
        )
        telemetry.KV_EVENT_RESYNCS.inc()
        self.blocks.cleared()
        self.send(kv_events_pb2.SubscribeResponse(snapshot=True))
        # Blocks it still holds would otherwise stay unknown until evicted (best effort:
        # vLLM keeps the blocks of running requests).
        if self.engine is not None and not await self.engine.reset_prefix_cache():
            log.warning("the prefix cache could not be reset while requests run")
        self._next = sequence


def changes(
    blocks: EngineBlocks, events: list[KVCacheEvent]
) -> list[kv_events_pb2.SubscribeResponse]:
    """What a batch of the engine's events changes in `blocks`, as messages to send in
    order: a message's removals all came before its stores, and a cleared cache is a
    snapshot of nothing."""
    sent: list[kv_events_pb2.SubscribeResponse] = []
    change = kv_events_pb2.SubscribeResponse()
    for event in events:
        if isinstance(event, BlockStored) and event.medium in _SERVED_MEDIA:
            # Each block's media as (identifier, offset) pairs; its bare keys (the LoRA
            # name, which roots the chain instead, a cache salt) are not media.
            media = [[tuple(key) for key in keys or () if isinstance(key, tuple | list)]
                     for keys in event.extra_keys or ()]  # fmt: skip
            stored = blocks.stored(
                event.block_hashes, event.parent_block_hash, event.token_ids,
                event.block_size, media, event.lora_name or "",
            )  # fmt: skip
            change.stored.extend(stored)
        elif isinstance(event, BlockRemoved) and event.medium in _SERVED_MEDIA:
            if change.stored:
                sent.append(change)
                change = kv_events_pb2.SubscribeResponse()
            change.removed.extend(blocks.removed(event.block_hashes))
        elif isinstance(event, AllBlocksCleared):
            blocks.cleared()
            sent = []
            change = kv_events_pb2.SubscribeResponse(snapshot=True)
    sent.append(change)
    return [c for c in sent if c.snapshot or c.stored or c.removed]
