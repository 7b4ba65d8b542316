"""What the tests read off a stage's Prometheus /metrics page."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def samples(url: str) -> dict[str, float]:
    """Every sample on the page: {name{labels}: value}, labels sorted; bare names unlabeled."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            found[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return found


def total(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    sum_ = 0.0
    for key, value in samples(url).items():
        sample, _, label_text = key.partition("{")
        if sample == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            sum_ += value
    return sum_
