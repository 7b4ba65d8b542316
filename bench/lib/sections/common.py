"""What more than one section of docs/benchmarks.md uses: the link to the notes written by
hand beside them, the serving table and its setting, and the figures' names."""

from __future__ import annotations

from pathlib import Path

from bench.lib.shapes import ANCHOR, ANCHORS, SAME_ENGINE, slug
from bench.lib.stats import suffix

# What the results show and why, written by hand: one file per section that has notes,
# linked from the page rather than pasted into it, so that every figure on the page is one
# a record holds.
NOTES = Path(__file__).resolve().parents[2] / "notes"


def notes_link(name: str) -> list[str]:
    """The line that links a section to its notes, bench/notes/`name` (none if absent)."""
    if not (NOTES / name).exists():
        return []
    path = f"bench/notes/{name}"
    return [f"Notes on these runs (a lab notebook, figures typed by hand): [{path}](../{path})"]


def table(result: dict) -> list[str]:
    """One row per server and level, with ratios to each anchor that ran."""
    rows = result["rows"]
    anchors = [a for a in ANCHORS if any(r["server"] == a for r in rows)]
    names = {ANCHOR: "vllm serve", SAME_ENGINE: "vllm serve, same engine"}
    lines = [
        "| server | concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | "
        + "".join(f"req/s vs {names[a]} | " for a in anchors)
        + "NIXL read share |",
        "|---|" + "---:|" * (8 + len(anchors)),
    ]
    top = max(r["concurrency"] for r in rows if r["server"] == ANCHOR)
    for r in rows:
        end = suffix(r["concurrency"], top)
        ratios = [
            1.0 if r["server"] == anchor else result.get(
                f"{slug(r['server'])}_vs_{anchor}_rps_ratio{end}", float("nan"))
            for anchor in anchors
        ]  # fmt: skip
        share = f"{100 * r['nixl_read_share']:.2f} %" if "nixl_read_share" in r else ""
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} "
            f"| {r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | "
            + "".join(f"{ratio:.2f} | " for ratio in ratios)
            + f"{share} |"
        )
    return lines


def setting(result: dict, what: str) -> str:
    return (
        f"Written by `make bench` on {result['when']} ({result['machine']}). Model: "
        f"{result['model']}; {result['requests']} streaming chat requests per level, {what} "
        f"each, {result['max_tokens']} tokens each, greedy. Every level has "
        "requests of its own (no prefix or media cache hits across levels), after a warm-up "
        "burst of its own. The client runs on the same machine. "
        f"Rounds: {result['rounds']}. In each round every server runs once, in turn; the "
        "table gives medians over the rounds, and each ratio is the median of the ratios "
        "measured within a round."
    )


def mean_replicas(row: dict) -> float:
    """What a run cost: the replicas serving (warm spares not counted), every role's, on
    average over its samples."""
    samples = row["replicas"]
    serving = sum(v for s in samples for k, v in s.items() if k != "t")
    return serving / max(1, len(samples))


# Each planner record's figure, beside the page.
PLANNER_FIGURES = {
    "planner": "benchmarks-planner.png",
    "planner_vllm": "benchmarks-planner-vllm.png",
    "planner_dynamo": "benchmarks-planner-dynamo.png",
}
# The planner records as the summary and its figure name them.
PLANNER_TITLES = {
    "planner": "simulated workers",
    "planner_vllm": "vLLM engines",
    "planner_dynamo": "P/D, beside Dynamo's planner",
}
# The summary's figures, beside the page: one per comparison the image load's does not draw.
SUMMARY_FIGURES = {
    "anchors": "benchmarks-anchors.png",
    "scale": "benchmarks-scale.png",
    "routing": "benchmarks-routing.png",
    "planners": "benchmarks-planners.png",
}
