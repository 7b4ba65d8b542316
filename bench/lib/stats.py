"""Percentiles, medians over rounds, and each server's ratios to the anchor beside it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from bench.lib.shapes import ANCHOR, ANCHORS, SHAPES, TAX, slug

Pair = tuple[str, str]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def suffix(concurrency: int, top: int) -> str:
    """Ratios at the highest level have plain keys; the others end in _c<level>."""
    return "" if concurrency == top else f"_c{concurrency}"


def anchor_pairs(rows: list[dict]) -> list[Pair]:
    """Every server beside each `vllm serve` anchor that ran."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    return [(server, anchor) for anchor in ANCHORS if anchor in servers
            for server in servers if server != anchor]  # fmt: skip


def shape_pairs(rows: list[dict]) -> list[Pair]:
    """Each Prism mode beside the anchors of its shape that ran, and the disaggregation
    tax: each split mode beside EPD."""
    servers = {r["server"] for r in rows}
    pairs = [(mode, anchor) for table in (SHAPES, TAX) for mode, anchors in table.items()
             for anchor in anchors if {mode, anchor} <= servers]  # fmt: skip
    return pairs + [(s, ANCHOR) for s in sorted(servers) if s != ANCHOR and ANCHOR in servers]


def ratios(rows: list[dict], pairs: list[Pair] | None = None) -> dict[str, float]:
    """Each server's requests/s and output tokens/s over its anchor's, and its TTFT p50
    minus the anchor's, at every level both ran (`pairs`: server and anchor; default:
    every server beside each `vllm serve`)."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    top = max(r["concurrency"] for r in rows)
    out = {}
    for server, anchor in anchor_pairs(rows) if pairs is None else pairs:
        for concurrency in sorted({c for _, c in by}):
            row, base = by.get((server, concurrency)), by.get((anchor, concurrency))
            if row is None or base is None:
                continue
            name = f"{slug(server)}_vs_{slug(anchor)}"
            end = suffix(concurrency, top)
            out[f"{name}_rps_ratio{end}"] = row["requests_per_s"] / base["requests_per_s"]
            out[f"{name}_tokens_ratio{end}"] = (
                row["output_tokens_per_s"] / base["output_tokens_per_s"]
            )
            out[f"{slug(server)}_minus_{slug(anchor)}_ttft_p50_ms{end}"] = (
                row["ttft_ms_p50"] - base["ttft_ms_p50"]
            )
    return out


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Per server and level, the median of each measure over the rounds, and the
    requests/s of every round."""
    rows = []
    for first in rounds[0]:
        which = (first["server"], first["concurrency"])
        same = [r for rows in rounds for r in rows if (r["server"], r["concurrency"]) == which]
        row = {
            key: float(np.median([r[key] for r in same])) if isinstance(value, float) else value
            for key, value in first.items()
        }
        if "requests_per_s" in first:
            row["requests_per_s_by_round"] = [r["requests_per_s"] for r in same]
        rows.append(row)
    return rows


def median_ratios(
    rounds: list[list[dict]], pairs: Callable[[list[dict]], list[Pair]] = anchor_pairs
) -> dict[str, float]:
    """Each ratio taken within a round, against the anchor run beside it; then the median."""
    per_round = [ratios(rows, pairs(rows)) for rows in rounds]
    return {key: float(np.median([r[key] for r in per_round])) for key in per_round[0]}
