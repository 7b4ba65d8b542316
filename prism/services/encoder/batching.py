"""Items of concurrent requests, encoded together.

An item waits at most `wait_s` for others to join it, and a batch closes early once it
holds `max_items` items. Identical items (by content key) in flight are encoded once: a
second request for one waits for the first one's result. One batch runs at a time, since
one device runs one forward pass at a time; items that arrive meanwhile form the next.
A batch that fails is tried again item by item, so that one bad item fails alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Batcher(Generic[T]):
    """Coalesces `submit` calls into calls of `encode` (run in a thread) over many items."""

    def __init__(
        self,
        encode: Callable[[Sequence[bytes]], Sequence[T]],
        max_items: int,
        wait_s: float,
        on_batch: Callable[[int], None] = lambda items: None,
        on_result: Callable[[str, T], None] = lambda key, result: None,
    ) -> None:
        if max_items < 1:
            raise ValueError(f"a batch holds at least one item, not {max_items}")
        if wait_s < 0:
            raise ValueError(f"the batch wait cannot be negative ({wait_s} s)")
        self.encode = encode
        self.max_items = max_items
        self.wait_s = wait_s
        # Called with the item count of every call of `encode` (every forward pass).
        self.on_batch = on_batch
        # Called before anyone waiting is answered: a cache filled there leaves no moment
        # in which an item is neither in flight nor cached.
        self.on_result = on_result
        # Keyed items waiting for a batch, in arrival order, and every keyed item not yet
        # answered (waiting or in the running batch): a repeat joins its future.
        self._waiting: dict[str, tuple[bytes, float]] = {}
        self._futures: dict[str, asyncio.Future[T]] = {}
        self._full = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._futures)

    async def submit(self, key: str, data: bytes) -> T:
        """The encoding of `data`, whose content `key` names."""
        future = self._futures.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            # Retrieved even when every caller has left, so asyncio reports no orphan.
            future.add_done_callback(lambda done: done.cancelled() or done.exception())
            self._futures[key] = future
            self._waiting[key] = (data, time.monotonic())
            if len(self._waiting) >= self.max_items:
                self._full.set()
            if self._runner is None or self._runner.done():
                self._runner = asyncio.create_task(self._run())
        # A caller that leaves does not take the batch, or the others' result, with it.
        return await asyncio.shield(future)

    async def _run(self) -> None:
        try:
            while self._waiting:
                if len(self._waiting) < self.max_items:
                    oldest = next(iter(self._waiting.values()))[1]
                    self._full.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(
                            self._full.wait(), oldest + self.wait_s - time.monotonic()
                        )
                keys = list(self._waiting)[: self.max_items]
                items = [self._waiting.pop(key)[0] for key in keys]
                results = await self._encode(items)
                for key, result in zip(keys, results, strict=True):
                    future = self._futures.pop(key)
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        self.on_result(key, result)
                        future.set_result(result)
        finally:
            # Cancelled (the server stops): nobody is left waiting for good.
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._waiting.clear()

    async def _encode(self, items: list[bytes]) -> list[T | Exception]:
        """Each item's encoding, or the error that item alone raises."""
        self.on_batch(len(items))
        try:
            results = await asyncio.to_thread(self.encode, items)
            if len(results) != len(items):
                raise RuntimeError(f"{len(items)} items were encoded as {len(results)}")
            return list(results)
        except Exception as exc:
            if len(items) == 1:
                return [exc]
        outcomes: list[T | Exception] = []
        for item in items:
            outcomes.extend(await self._encode([item]))
        return outcomes
