"""Prometheus metrics: one registry per process, served on the stage's metrics port.

Stage objects keep their own plain counters (e.g. `TransferStats`, `CacheStats`); the
collectors here read them at scrape time, so nothing is counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prism.cache import CacheStats

if TYPE_CHECKING:
    from prism.transfer import TransferAgent


class StatsCollector(Collector):
    """Exposes numbers read by `read()` at scrape time: name -> (kind, help, value)."""

    def __init__(self, read: Callable[[], dict[str, tuple[str, str, float]]]):
        self._read = read

    def collect(self) -> Iterable[Metric]:
        for name, (kind, help_text, value) in self._read().items():
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=value)


def serve_metrics(port: int, host: str, collectors: Iterable[Collector] = ()) -> None:
    """Registers `collectors` and serves /metrics on `port` (0: no endpoint)."""
    for collector in collectors:
        REGISTRY.register(collector)
    if port:
        start_http_server(port, addr=host)


def transfer_collector(agent: TransferAgent) -> StatsCollector:
    """NIXL pool and transfer counters of this process's agent."""

    def read() -> dict[str, tuple[str, str, float]]:
        s = agent.stats
        return {
            "prism_nixl_pool_bytes_in_use": ("gauge", "NIXL pool bytes used", s.pool_bytes_in_use),
            "prism_nixl_published": ("counter", "Tensors published for peers", s.published),
            "prism_nixl_released": ("counter", "Published tensors freed once read", s.released),
            "prism_nixl_reclaimed": ("counter", "Published tensors freed unread", s.reclaimed),
            "prism_nixl_bytes_read": ("counter", "Bytes read from peers", s.bytes_moved),
            "prism_nixl_reads": ("counter", "NIXL reads completed", s.transfers),
            "prism_nixl_read_seconds": ("counter", "NIXL read seconds", s.transfer_seconds_total),
        }

    return StatsCollector(read)


def cache_collector(prefix: str, what: str, stats: CacheStats) -> StatsCollector:
    """Hits, misses, evictions and size of a `ByteLru` cache."""

    def read() -> dict[str, tuple[str, str, float]]:
        return {
            f"{prefix}_hits": ("counter", f"{what} cache hits", stats.hits),
            f"{prefix}_misses": ("counter", f"{what} cache misses", stats.misses),
            f"{prefix}_evictions": ("counter", f"{what} cache evictions", stats.evictions),
            f"{prefix}_bytes": ("gauge", f"Bytes held by the {what.lower()} cache", stats.bytes),
        }

    return StatsCollector(read)
