"""A least-recently-used cache bounded by the bytes of its values."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


class ByteLru(Generic[V]):
    """Thread-safe LRU; `size(value)` gives a value's bytes. A zero bound disables it."""

    def __init__(self, max_bytes: int, size: Callable[[V], int]):
        self.max_bytes = max_bytes
        self._size = size
        self._items: OrderedDict[str, V] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: str) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return value

    def put(self, key: str, value: V) -> None:
        nbytes = self._size(value)
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= self._size(old)
            self._items[key] = value
            self.stats.bytes += nbytes
            while self.stats.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.stats.bytes -= self._size(evicted)
                self.stats.evictions += 1
            self.stats.entries = len(self._items)
