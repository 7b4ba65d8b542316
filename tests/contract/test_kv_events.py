"""A worker's KV events service: vLLM's own ZMQ publisher on a local socket, read by the
worker, served to subscribers as a snapshot then changes; gaps filled from the replay
buffer, or the view started over when it no longer holds them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from prometheus_client import REGISTRY
from support.waiting import until
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from prism.engine.kv_events import KvEvents
from prism.proto.stage.v1 import kv_events_pb2
from prism.services.worker import kv_publisher
from prism.services.worker.serving import kv_events_service

BLOCK = 4


def stored(hash_: bytes, parent: bytes | None, first_token: int) -> BlockStored:
    return BlockStored(
        block_hashes=[hash_],
        parent_block_hash=parent,
        token_ids=list(range(first_token, first_token + BLOCK)),
        block_size=BLOCK,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def removed(*hashes: bytes) -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium="GPU")


def test_a_subscriber_gets_a_snapshot_then_changes_and_a_snapshot_when_it_falls_behind(
    tmp_path: Path,
):
    async def main() -> None:
        kv = KvEvents(tmp_path)
        publisher = kv_events_service(kv)
        stream = publisher.subscribe(kv_events_pb2.SubscribeRequest())
        first = await anext(stream)
        assert first.snapshot and not first.stored
        kv.apply([stored(b"a", None, 0), stored(b"b", b"a", 4)])
        change = await anext(stream)
        assert not change.snapshot and len(change.stored) == 2 and not change.removed
        kv.apply([removed(b"b")])
        assert list((await anext(stream)).removed) == [change.stored[1]]
        # Removed after stored within one batch: two messages, in order.
        kv.apply([stored(b"b", b"a", 4), removed(b"b")])
        assert len((await anext(stream)).stored) == 1
        assert len((await anext(stream)).removed) == 1
        # Past the backlog, the changes give way to one snapshot of all that is held.
        for i in range(kv_publisher._BACKLOG + 1):
            kv.apply([stored(b"x%d" % i, None, 100 + i)])
        snapshot = await anext(stream)
        assert snapshot.snapshot and len(snapshot.stored) == 1 + kv_publisher._BACKLOG + 1
        kv.apply([AllBlocksCleared()])
        cleared = await anext(stream)
        assert cleared.snapshot and not cleared.stored
        publisher.close()
        assert await anext(stream, None) is None
        assert not publisher._subscribers

    asyncio.run(main())


class Engine:
    """vLLM's ZMQ publisher on the worker's sockets, as an engine core runs it, and the
    worker's reader of it, started when `read` is called."""

    def __init__(self, kv: KvEvents, buffer_steps: int) -> None:
        config = kv.config()
        self.kv = kv
        self.publisher = ZmqEventPublisher(
            0, config.endpoint, config.replay_endpoint, buffer_steps=buffer_steps
        )
        self.reader: asyncio.Task | None = None
        # Batches published so far: the next one's sequence number.
        self.published = 0

    async def publish(self, *events: object) -> int:
        """Publishes a batch; returns its sequence number once the publisher's thread has
        sent it and kept it for replay."""
        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))
        # The thread marks a batch done once it is sent and kept: vLLM tells it no other way.
        queue = self.publisher._event_queue
        assert await until(lambda: not queue.unfinished_tasks)
        self.published += 1
        return self.published - 1

    async def read(self) -> None:
        """Starts the worker's reader; returns once it is subscribed. A PUB socket drops
        what it sends before a subscription reaches it, and nothing tells when one has:
        empty batches go out until the reader has one (it replays those dropped, as any
        batch it missed)."""
        self.reader = asyncio.create_task(self.kv.read(None))
        start = self.kv._next
        async with asyncio.timeout(10):
            while True:
                await self.publish()
                if await until(lambda: self.kv._next > start, timeout=0.1):
                    return

    async def read_up_to(self, sequence: int) -> None:
        assert await until(lambda: self.kv._next > sequence)

    async def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reader
        self.publisher.shutdown()


def resyncs_total() -> float:
    return REGISTRY.get_sample_value("prism_kv_event_resyncs_total") or 0.0


def held(kv: KvEvents) -> set[int]:
    return set(kv.blocks.keys())


def test_the_worker_reads_the_engines_events_and_fills_a_gap_from_its_replay(tmp_path: Path):
    async def main() -> None:
        kv = KvEvents(tmp_path)
        # A replay buffer that holds every batch, those `read` sends included.
        engine = Engine(kv, buffer_steps=1000)
        resyncs = resyncs_total()
        try:
            # Published before the worker reads: missed, then replayed.
            await engine.publish(stored(b"a", None, 0))
            await engine.read()
            await engine.read_up_to(await engine.publish(stored(b"b", b"a", 4)))
            assert len(held(kv)) == 2
            await engine.read_up_to(await engine.publish(removed(b"a")))
            assert len(held(kv)) == 1
            assert resyncs_total() == resyncs
        finally:
            await engine.close()

    asyncio.run(main())


def test_events_lost_past_the_replay_buffer_start_the_view_over(tmp_path: Path):
    async def main() -> None:
        kv = KvEvents(tmp_path)
        engine = Engine(kv, buffer_steps=1)
        resyncs = resyncs_total()
        try:
            await engine.publish(stored(b"a", None, 0))
            await engine.publish(stored(b"b", b"a", 4))
            # The buffer holds one batch: by the first the reader has, the two before it
            # are lost for good.
            await engine.read()
            await engine.read_up_to(
                await engine.publish(stored(b"c", None, 8), stored(b"d", b"a", 12))
            )
            assert resyncs_total() == resyncs + 1
            # What is known is what came after the gap; a block after one lost is left out.
            assert len(held(kv)) == 1 and kv.blocks.orphans == 1
        finally:
            await engine.close()

    asyncio.run(main())
