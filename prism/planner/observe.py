"""What the planner reads: the fronts' /metrics, summed over every front, and what changed
between two reads (an interval's Observation).

The fronts see every request end to end: their histograms of the time to first token, of
the time between tokens, and of each stage call's time to its first reply
(`prism_stage_first_reply_seconds{role}`) say both whether the goals are met and which
role is slow; the seconds stage calls were open (`prism_stage_call_seconds_total{role}`),
how busy each role is; the calls waiting for a first reply
(`prism_stage_calls_waiting{role}`), each role's queue, and with the first replies, the
calls arriving at it. A URL whose host resolves to several addresses (a headless Service) is read
at each, so that every front counts.
"""

from __future__ import annotations

import collections
import ipaddress
import math
import socket
import urllib.request
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

from prometheus_client.parser import text_string_to_metric_families

from prism.planner.decide import Observation

TTFT = "prism_time_to_first_token_seconds"
ITL = "prism_inter_token_latency_seconds"
FIRST_REPLY = "prism_stage_first_reply_seconds"
CALL_SECONDS = "prism_stage_call_seconds"
WAITING = "prism_stage_calls_waiting"
_READ = (TTFT, ITL, FIRST_REPLY, CALL_SECONDS, WAITING)

# (sample name, its labels but `le`, `le`) → value, summed over the fronts.
Key = tuple[str, tuple[tuple[str, str], ...], str]
Sample = dict[Key, float]


def addresses(url: str) -> list[str]:
    """`url` once per address its host resolves to (itself where the host is an IP)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        ipaddress.ip_address(host)
        return [url]
    except ValueError:
        pass
    resolved = socket.getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM)
    found = sorted({str(info[4][0]) for info in resolved})
    port = f":{parts.port}" if parts.port else ""
    return [
        urlunsplit(parts._replace(netloc=f"[{a}]{port}" if ":" in a else f"{a}{port}"))
        for a in found
    ]


def parse(text: str, into: Sample | None = None) -> Sample:
    """The histograms the planner reads from one /metrics text, added to `into`."""
    sample: Sample = into if into is not None else collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.name not in _READ:
            continue
        for name, labels, value in (s[:3] for s in family.samples):
            le = labels.pop("le", "")
            sample[(name, tuple(sorted(labels.items())), le)] += value
    return sample


def scrape(urls: Iterable[str], timeout: float = 2.0) -> Sample:
    """The fronts' histograms, summed; raises OSError if a front does not answer."""
    sample: Sample = collections.defaultdict(float)
    for url in (a for given in urls for a in addresses(given)):
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            parse(reply.read().decode(), sample)
    return sample


def _delta(before: Sample, after: Sample) -> Sample:
    """What each series counted in between; a series that went down started over (a front
    restarted), so all of it is new, as Prometheus' rate() reads a reset."""
    out: Sample = {}
    for key, value in after.items():
        previous = before.get(key, 0.0)
        out[key] = value - previous if value >= previous else value
    return out


def _buckets(delta: Sample, histogram: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of `histogram`'s buckets, over all its series."""
    counts: dict[float, float] = collections.defaultdict(float)
    for (name, _, le), value in delta.items():
        if name == f"{histogram}_bucket":
            counts[float(le)] += value
    return sorted(counts.items())


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The `q` quantile of a histogram's cumulative buckets, interpolated within its
    bucket as Prometheus' histogram_quantile() does; None when it counted nothing. Written
    here: prometheus_client exports histograms but computes no quantiles."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # the highest finite bound
            return lower + (bound - lower) * (
                (rank - below) / (count - below) if count > below else 1.0
            )
        lower, below = bound, count
    return lower


def _waiting(sample: Sample) -> dict[str, float]:
    return {dict(series)["role"]: value
            for (name, series, _), value in sample.items() if name == WAITING}  # fmt: skip


def observation(before: Sample, after: Sample, seconds: float) -> Observation:
    """What the interval of `seconds` between two scrapes showed."""
    delta = _delta(before, after)
    waiting, waited = _waiting(after), _waiting(before)
    calls: dict[str, int] = collections.defaultdict(int)
    took: dict[str, float] = collections.defaultdict(float)
    open_s: dict[str, float] = collections.defaultdict(float)
    first_tokens = 0
    for (name, series, _), value in delta.items():
        if name == f"{FIRST_REPLY}_count":
            calls[dict(series)["role"]] += int(value)
        elif name == f"{FIRST_REPLY}_sum":
            took[dict(series)["role"]] += value
        elif name == f"{CALL_SECONDS}_total":
            open_s[dict(series)["role"]] += value
        elif name == f"{TTFT}_count":
            first_tokens += int(value)
    # Answered, and those still waiting beyond the queue the interval began with.
    arrived = {role: max(0.0, calls.get(role, 0) + count - waited.get(role, 0.0))
               for role, count in waiting.items()}  # fmt: skip
    return Observation(
        seconds=seconds,
        first_tokens=first_tokens,
        ttft_s=quantile(0.9, _buckets(delta, TTFT)),
        itl_s=quantile(0.9, _buckets(delta, ITL)),
        calls=dict(calls),
        first_reply_s={role: took[role] / count for role, count in calls.items() if count},
        open_s=dict(open_s),
        arrived=arrived,
        waiting=waiting,
        waited=waited,
    )
