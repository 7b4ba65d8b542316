"""The processor follows a worker's KV events (an in-process KvEventsService fed vLLM-shaped
events) into the router's index: it routes a prompt to the worker that holds it, drops a
worker whose stream ends, resynchronizes from its snapshot when it is back, and forgets
one that leaves the registry."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from vllm.distributed.kv_events import BlockStored

from prism.engine.kv_events import KvEvents
from prism.kv_index import prompt_keys
from prism.media.prompt import PromptMedia
from prism.modes import MODES
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.server import Server, start_server
from prism.runtime.ports import free_port
from prism.services.processor.inputs import ModelInputs
from prism.services.processor.pipeline import Pipeline
from prism.services.worker.kv_publisher import KvPublisher
from prism.services.worker.serving import kv_events_service

BLOCK = 4


async def serve(publisher: KvPublisher, port: int) -> Server:
    return await start_server(f"127.0.0.1:{port}", publisher.service.add_to_server, [])


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


def test_the_processor_follows_a_workers_cache(tmp_path: Path):
    async def main() -> None:
        kv = KvEvents(tmp_path)
        kv.engine = SimpleNamespace(vllm_config=SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BLOCK)))  # fmt: skip
        publisher = kv_events_service(kv)
        port = free_port()
        holder, idle = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
        registry = StaticRegistry({"worker": [idle, holder]})
        pipeline = Pipeline(MODES["epd"], Router(registry, "kv"), ModelInputs(tokens={"image": 99}))
        router, watch = pipeline.router, pipeline.cache_watch
        assert watch is not None
        server = await serve(publisher, port)
        try:
            watch.refresh()
            prompt = list(range(1, 11))  # Two full blocks and a part.
            kv.apply([BlockStored(
                block_hashes=[b"a", b"b"], parent_block_hash=None, token_ids=prompt[:8],
                block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None,
            )])  # fmt: skip
            await until(lambda: router.index.size(holder) == 2)
            assert router.block_size == BLOCK
            keys = pipeline._keys(prompt, PromptMedia())
            assert keys == prompt_keys(prompt, [], BLOCK)
            assert [router.pick("worker", keys=keys) for _ in range(3)] == [holder] * 3
            # Blocks from an image whose tokens the processor cannot count are not scored.
            assert pipeline._keys([1, 2, 3, 4, 5, 99, 7, 8, 9], PromptMedia()) == keys[:1]
            # The stream ends: what it said no longer counts.
            await server.server.stop(None)
            await until(lambda: router.index.size(holder) == 0)
            # Back: its snapshot says it all again.
            server = await serve(publisher, port)
            await until(lambda: router.index.size(holder) == 2, timeout=15)
            # Gone from the registry: forgotten for good.
            registry._peers["worker"] = [idle]
            watch.refresh()
            assert router.index.size(holder) == 0
        finally:
            await pipeline.close()
            await server.server.stop(None)

    asyncio.run(main())
