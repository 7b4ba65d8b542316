"""Prometheus metrics: one registry per process, served on the stage's metrics port.

Stage objects keep their own plain counters (e.g. `TransferStats`, `CacheStats`); the
collectors here read them at scrape time, so nothing is counted twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import prism
from prism.cache import CacheStats

if TYPE_CHECKING:
    from prism.transfer import Transfer


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


def transfer_collector(agent: Transfer) -> StatsCollector:
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


# Request metrics of the stages clients talk to: the gateway (endpoint: the HTTP path,
# status: the HTTP code) and the processor (endpoint: the RPC, status: the gRPC code).
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            30.0, 60.0, 120.0)  # fmt: skip
# The encoder's forward passes (the histogram's count) and the items each one encoded.
ENCODER_BATCH_ITEMS = Histogram(
    "prism_encoder_batch_items",
    "Items encoded by one forward pass of a tower, by modality",
    ["modality"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
# Which Prism a process runs, as vLLM's and Dynamo's build info: `prism_build_info{version}`.
Info("prism_build", "The Prism release this process runs").info({"version": prism.__version__})
REQUESTS = Counter("prism_requests", "Requests answered, by final status", ["endpoint", "status"])
IN_FLIGHT = Gauge("prism_requests_in_flight", "Requests being answered", ["endpoint"])
WAITING = Gauge(
    "prism_requests_waiting",
    "Requests in flight without a first token yet: the queue depth as clients see it",
    ["endpoint"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "prism_time_to_first_token_seconds", "Time to first token", ["endpoint"], buckets=_SECONDS
)
INTER_TOKEN_LATENCY = Histogram(
    "prism_inter_token_latency_seconds", "Time between tokens", ["endpoint"], buckets=_SECONDS
)
REQUEST_DURATION = Histogram(
    "prism_request_duration_seconds",
    "End-to-end time of requests that completed",
    ["endpoint"],
    buckets=_SECONDS,
)
PROMPT_TOKENS = Counter("prism_prompt_tokens", "Prompt tokens of answered requests", ["endpoint"])
COMPLETION_TOKENS = Counter(
    "prism_completion_tokens", "Tokens generated for answered requests", ["endpoint"]
)
BATCH_REQUESTS = Counter(
    "prism_batch_requests",
    "Requests of batches answered at this front, by outcome (completed: 2xx; failed)",
    ["outcome"],
)
BATCH_IN_FLIGHT = Gauge("prism_batch_requests_in_flight", "Requests of batches in flight here")
LORA_REQUESTS = Counter(
    "prism_lora_requests", "Requests for a LoRA adapter, by its name", ["adapter"]
)
LORA_TOKENS = Counter(
    "prism_lora_tokens",
    "Tokens of answered requests for a LoRA adapter, by its name and kind (prompt, completion)",
    ["adapter", "kind"],
)
LORA_LOADED = Gauge(
    "prism_engine_lora_adapters",
    "LoRA adapters this engine holds loaded (1 each), by name",
    ["adapter"],
)
FIRST_TOKEN_DIVERGENCES = Counter(
    "prism_first_token_divergences",
    "P/D requests whose decode drew another first token than their prefill (both seeded "
    "alike: each should be none)",
)
NIXL_READ_SECONDS = Histogram(
    "prism_nixl_read_seconds", "Time of one NIXL read of a tensor", ["tensor"], buckets=_SECONDS
)


KV_BLOCKS_HELD = Gauge(
    "prism_kv_blocks_held", "Blocks this worker's prefix cache holds, as its KV events tell"
)
KV_EVENT_RESYNCS = Counter(
    "prism_kv_event_resyncs",
    "Times KV events were lost past the engine's replay buffer and the view started over",
)


ENCODE_FALLBACKS = Counter(
    "prism_encode_fallbacks",
    "Requests whose images and videos the worker encoded because no encoder could, by cause: "
    "unavailable (none serving), full (all at their bound), failed (the encode failed)",
    ["cause"],
)
STAGE_FIRST_REPLY = Histogram(
    "prism_stage_first_reply_seconds",
    "From a stage call to its first reply (queueing included), by role: an encoder's "
    "embeddings, a worker's or prefill's first token, a decode's first token after its KV "
    "read; what the planner weighs each role's share of the time to first token by",
    ["role"],
    buckets=_SECONDS,
)
STAGE_CALL_SECONDS = Counter(
    "prism_stage_call_seconds",
    "Seconds stage calls were open, counted as each ends, by role: over an interval, the "
    "calls open on the role on average (its queue and what it runs), times the interval",
    ["role"],
)
STAGE_CALLS_WAITING = Gauge(
    "prism_stage_calls_waiting",
    "Stage calls made and not yet at their first reply, by role: the role's queue and what "
    "it is starting on; with the first replies counted, the calls a second arriving at it",
    ["role"],
)
PLANNER_REPLICAS = Gauge(
    "prism_planner_replicas",
    "Replicas of each role: desired (the planner's) and running",
    ["role", "state"],
)
PLANNER_DECISIONS = Counter(
    "prism_planner_decisions",
    "Replica changes the planner made, by role and reason",
    ["role", "reason"],
)
ROUTING_DECISIONS = Counter(
    "prism_routing_decisions", "Replicas picked for calls, by policy and role", ["policy", "role"]
)
ROUTING_OVERLAP = Histogram(
    "prism_routing_overlap",
    "kv routing: share of the prompt's blocks the picked replica held",
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
)
KV_INDEX_BLOCKS = Gauge(
    "prism_kv_index_blocks", "Blocks the processor knows each replica holds", ["replica"]
)
KV_EVENTS_RECEIVED = Counter(
    "prism_kv_events_received", "Blocks stored or evicted that workers reported", ["replica"]
)
KV_SNAPSHOTS = Counter(
    "prism_kv_snapshots",
    "Snapshots a worker sent: one per subscription, more after a loss (a resynchronization)",
    ["replica"],
)


class RequestTimer:
    """Times one streamed request from its replies (messages with `token_ids` and `usage`,
    the request's counts so far): in flight, waiting, time to first token, between tokens,
    end to end; and counts its tokens when it ends."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.start = time.perf_counter()
        self.last: float | None = None
        self._usage: Any = None
        # Looked up once: `reply` runs for every token of every request.
        self._waiting = WAITING.labels(endpoint)
        self._between = INTER_TOKEN_LATENCY.labels(endpoint)
        IN_FLIGHT.labels(endpoint).inc()
        self._waiting.inc()

    def reply(self, message: Any) -> None:
        count = len(message.token_ids)
        if count:
            now = time.perf_counter()
            if self.last is None:
                TIME_TO_FIRST_TOKEN.labels(self.endpoint).observe(now - self.start)
                self._waiting.dec()
            else:
                gap = (now - self.last) / count
                for _ in range(count):
                    self._between.observe(gap)
            self.last = now
        if message.HasField("usage"):
            self._usage = message.usage

    def finish(self, completed: bool) -> None:
        if self._usage is not None:
            PROMPT_TOKENS.labels(self.endpoint).inc(self._usage.prompt_tokens)
            COMPLETION_TOKENS.labels(self.endpoint).inc(self._usage.completion_tokens)
        if completed:
            REQUEST_DURATION.labels(self.endpoint).observe(time.perf_counter() - self.start)
        if self.last is None:
            self._waiting.dec()
        IN_FLIGHT.labels(self.endpoint).dec()


def gauge(name: str, help_text: str, read: Callable[[], float]) -> StatsCollector:
    """A gauge read at scrape time."""
    return StatsCollector(lambda: {name: ("gauge", help_text, read())})


def info(name: str, help_text: str, labels: dict[str, str]) -> None:
    """An info metric (`NAME_info{labels} 1`) of this process's settings."""
    Info(name, help_text).info(labels)
