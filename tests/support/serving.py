"""An in-process gRPC server on an event loop thread of its own, for sync tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prism.rpc.server import Server, start_server


@contextlib.contextmanager
def serving(register: Callable[[Any], None], services: list[str]) -> Iterator[str]:
    """A gRPC server (`start_server`, serving) on an event loop thread of its own, for
    sync tests; yields its address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Server:
        server = await start_server("127.0.0.1:0", register, services)
        await server.set_serving(services)
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
