"""Figures read from a server's Prometheus /metrics page."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or set(sample.labels) <= {"tensor"}
    }


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (every label, or those with `labels`) on a /metrics
    page."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def prompt_sources(url: str) -> dict[str, float]:
    """A vLLM engine's prompt tokens by where their KV came from (computed, its prefix
    cache, or read from another engine: "external_kv_transfer")."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    sources: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels["source"]
                sources[source] = sources.get(source, 0.0) + sample.value
    return sources
