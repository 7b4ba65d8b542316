"""The anchors' section (bench/serve.py --anchors, bench/results/anchors.json): each Prism
mode beside NVIDIA Dynamo and vLLM's own P/D, and the disaggregation tax, each against its
goal."""

from __future__ import annotations

from dataclasses import dataclass

from bench.lib.sections.common import notes_link, setting, table
from bench.lib.shapes import ANCHOR, TAX, slug
from bench.lib.stats import shape_pairs, suffix

# The goals of docs/benchmarks.md, each checked where it was measured.
RPS_GOAL, TTFT_GOAL_MS, TAX_GOAL = 1.0, 2.0, 0.8
# Each server as the page names it beside a Prism mode.
NAMES = {ANCHOR: "vllm serve", "dynamo_agg": "Dynamo aggregated", "dynamo_pd": "Dynamo P/D",
         "dynamo_e_pd": "Dynamo E/PD", "vllm_pd": "vLLM P/D (NixlConnector + proxy)",
         "epd": "Prism EPD"}  # fmt: skip


@dataclass(frozen=True)
class Goal:
    """A Prism mode beside another server, against its goal: the requests/s ratio and the
    TTFT p50 difference (ms) at each level, None where the record has none."""

    mode: str
    other: str
    rps: dict[int, float | None]
    ttft: dict[int, float | None]
    goal: str
    met: bool

    @property
    def beside(self) -> str:
        return NAMES.get(self.other, self.other)


def goals(result: dict) -> list[Goal]:
    """Each Prism mode of `result` (a serve.py record) beside the anchor of its shape, and
    each split mode beside EPD, with its goal and whether the record meets it."""
    levels = sorted({r["concurrency"] for r in result["rows"]})
    low, top = levels[0], levels[-1]
    found = []
    for mode, other in shape_pairs(result["rows"]):
        # `vllm serve` is of EPD's shape alone.
        if other == ANCHOR and mode != "epd":
            continue
        name = f"{slug(mode)}_vs_{slug(other)}"
        rps = {c: result.get(f"{name}_rps_ratio{suffix(c, top)}") for c in levels}
        ttft = {c: result.get(f"{slug(mode)}_minus_{slug(other)}_ttft_p50_ms{suffix(c, top)}")
                for c in levels}  # fmt: skip
        if mode in TAX and other in TAX[mode]:
            goal = f"req/s at c={top} ≥ {TAX_GOAL:.1f}x EPD"
            met = rps[top] is not None and rps[top] >= TAX_GOAL
        else:
            goal = f"req/s at c={top} ≥ {RPS_GOAL:.1f}x; TTFT p50 at c={low} ≤ +{TTFT_GOAL_MS:g} ms"
            met = (rps[top] or 0) >= RPS_GOAL and (
                ttft[low] if ttft[low] is not None else 1e9
            ) <= TTFT_GOAL_MS
        found.append(Goal(mode, other, rps, ttft, goal, met))
    return found


def anchors_section(result: dict) -> str:
    """Each Prism mode beside the anchors of its shape, and the disaggregation tax."""
    levels = sorted({r["concurrency"] for r in result["rows"]})
    lines = [
        "## Beside NVIDIA Dynamo and vLLM's own P/D", "",
        setting(result, "one 64x48 image").replace("`make bench`", "`make bench-anchors`"), "",
        "Anchors: NVIDIA Dynamo 1.6.1 (`dynamo.frontend` and `dynamo.vllm` on vLLM 0.31 for "
        "the CPU, in .anchors/dynamo: file discovery, TCP requests, ZMQ events; aggregated, "
        "P/D with the NixlConnector, and E/PD with its encode worker), vLLM's own P/D (two "
        "`vllm serve` with the NixlConnector behind bench/pd_proxy.py, the protocol of vLLM's "
        "toy proxy) and `vllm serve`. Engines sit on cores the same way on every side: one "
        "engine keeps vLLM's own binding; a prefill and a decode get a core each.", "",
        *table(result), "",
        "Each Prism mode beside the anchor of its shape (requests/s ratio; TTFT p50 "
        "difference, ms), and the disaggregation tax (each split mode beside Prism EPD):", "",
        "| Prism | beside | " + " | ".join(f"req/s c={c}" for c in levels) + " | "
        + " | ".join(f"TTFT p50 ms c={c}" for c in levels) + " | goal | met |",
        "|---|---|" + "---:|" * (2 * len(levels)) + "---|---|",
    ]  # fmt: skip
    for goal in goals(result):
        lines.append(
            f"| {goal.mode} | {goal.beside} | "
            + " | ".join("" if v is None else f"{v:.2f}" for v in goal.rps.values())
            + " | "
            + " | ".join("" if v is None else f"{v:+.1f}" for v in goal.ttft.values())
            + f" | {goal.goal} | {'yes' if goal.met else '**no**'} |"
        )
    if result.get("not_run"):
        lines += ["", "Not run here: " + "; ".join(result["not_run"]) + "."]
    lines += ["", *notes_link("anchors.md")]
    return "\n".join(lines) + "\n"
