"""The page's first section, where Prism stands: each comparison in a sentence or a small
table beside its figure, every figure in it computed from the records (bench/results/) and
each run named by its date and machine. The sections after it hold the runs' settings and
full tables."""

from __future__ import annotations

from typing import Any

from bench.lib.sections.anchors import goals
from bench.lib.sections.batch import BAR as BATCH_BAR
from bench.lib.sections.common import PLANNER_TITLES, SUMMARY_FIGURES
from bench.lib.sections.scale import LOW_BAR, TOP_BAR, TTFT_BAR, front_bars
from bench.lib.shapes import ANCHOR

# The make target that writes each record the summary reads.
TARGETS = {
    "image": "bench",
    "anchors": "bench-anchors",
    "scale": "bench-scale",
    "routing": "bench-routing",
    "planner": "bench-planner",
    "planner_vllm": "bench-planner-vllm",
    "planner_dynamo": "bench-planner-dynamo",
    "batch": "bench-batch",
}
# Routing's policies that are not routing policies: the baseline and the ideal.
BASELINE, IDEAL = "round-robin", "one worker"


def summary_section(results: dict[str, dict[str, Any]]) -> list[str]:
    """The summary of the records in `results` (by name) that it compares, as lines; none
    when there are none."""
    parts = {"image": image_part, "anchors": anchors_part, "scale": scale_part,
             "routing": routing_part, "batch": batch_part}  # fmt: skip
    lines = [line for name, part in parts.items() if name in results
             for line in part(results[name])]  # fmt: skip
    planners = {name: results[name] for name in PLANNER_TITLES if name in results}
    if planners:
        lines += planners_part(planners)
    if not lines:
        return []
    shown = [results[name] for name in TARGETS if name in results]
    models = ", ".join(sorted({r["model"] for r in shown}))
    return [
        "## Where Prism stands", "",
        f"**CPU figures only**, with tiny models of random weights ({models}) or simulated "
        "engines; Prism's serving on a GPU is not measured yet ([docs/gpu.md](gpu.md)). "
        "Each comparison names its run's date and machine; every figure in it is computed "
        "from that run's record (bench/results/), and its section below gives the run's "
        "setting and tables.", "",
        *lines,
    ]  # fmt: skip


def run(name: str, result: dict) -> str:
    """A run as the summary names it: its make target, date and machine."""
    return f"`make {TARGETS[name]}`, {result['when']}, {result['machine']}"


def listed(items: list[str]) -> str:
    """`a`, `a and b`, `a, b and c`."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def batch_part(result: dict) -> list[str]:
    """Interactive requests beside a batch, and `prism run-batch` beside `vllm run-batch`."""
    beside, ratio = result["beside"], result["beside"]["batch_api_p99_ratio"]
    lines = [
        f"**Batches beside interactive traffic** ({run('batch', result)}): interactive TTFT "
        f"p99 {ratio:.2f}x its value alone beside the Batch API's batch (bar {BATCH_BAR}x: "
        f"{verdict(ratio <= BATCH_BAR)}), the batch answering "
        f"{beside['batch_api_lines_per_s']:.0f} lines/s meanwhile "
        f"({beside['batch_alone_lines_per_s']:.0f} alone); the same chats from "
        f"{result['clients']} plain clients: {beside['clients_p99_ratio']:.2f}x."
    ]
    run_batch = result.get("run_batch")
    if run_batch:
        lines[0] += (
            f" `prism run-batch` took {run_batch['prism_s'] / run_batch['vllm_s']:.2f}x "
            f"`vllm run-batch`'s time on {run_batch['lines']} image chats, start included, "
            f"{run_batch['same_answers']} of {run_batch['lines']} answers the same."
        )
    return [*lines, ""]


def image_part(result: dict) -> list[str]:
    """EPD against `vllm serve` on the image load, against the goal of EPD's shape."""
    goal = next((g for g in goals(result) if (g.mode, g.other) == ("epd", ANCHOR)), None)
    levels = [c for c, v in goal.rps.items() if v is not None] if goal else []
    if goal is None or not levels:
        return []
    rounds = result["rounds"]
    return [
        f"**The image load against `vllm serve`** ({run('image', result)}, {rounds} "
        f"round{'s' if rounds != 1 else ''}): EPD serves "
        f"{listed([f'{goal.rps[c]:.2f}x' for c in levels])} `vllm serve`'s requests/s at "
        f"concurrency {listed([str(c) for c in levels])}, its TTFT p50 "
        f"{listed([cell(goal.ttft[c], '+.1f') for c in levels])} ms from `vllm serve`'s; "
        f"goal ({goal.goal}): {verdict(goal.met)}.", "",
        "![requests/s of each server by concurrency, image load](benchmarks-rps.png)", "",
    ]  # fmt: skip


def anchors_part(result: dict) -> list[str]:
    """Each Prism mode beside the anchor of its shape, and the tax, against their goals."""
    found = goals(result)
    if not found:
        return []
    levels = list(found[0].rps)
    low, top = levels[0], levels[-1]
    met = sum(g.met for g in found)
    return [
        f"**Beside NVIDIA Dynamo and vLLM's own P/D** ({run('anchors', result)}, "
        f"{result['rounds']} rounds): {met} of {len(found)} goals met.", "",
        f"| Prism | beside | req/s ratio, c={top} | TTFT p50 ms, c={low} | goal | met |",
        "|---|---|---:|---:|---|---|",
        *(
            f"| {g.mode} | {g.beside} | {cell(g.rps[top], '.2f')} | {cell(g.ttft[low], '+.1f')} "
            f"| {g.goal} | {'yes' if g.met else '**not met**'} |"
            for g in found
        ),
        "", f"![requests/s of each server by concurrency]({SUMMARY_FIGURES['anchors']})", "",
    ]  # fmt: skip


def cell(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def scale_part(result: dict) -> list[str]:
    """Each Prism front against Dynamo's at the lowest and highest level of streams."""
    rows = result["rows"]
    low, top = min(r["streams"] for r in rows), max(r["streams"] for r in rows)
    dynamo = {r["streams"]: r["requests_per_s"] for r in rows if r["front"] == "dynamo"}
    bars = front_bars(result)
    if bars:
        fronts = "; ".join(
            f"{b.front} {b.low_rps:.2f}x, {b.top_rps:.2f}x, {b.ttft:.2f}x: {verdict(b.met)}"
            for b in bars
        )
        compared = (
            f"Prism's fronts against Dynamo's ({dynamo[low]:.1f} and {dynamo[top]:.1f} "
            f"requests/s), requests/s at {low} and {top} streams and TTFT p99 at {top} (bars: "
            f"≥ {LOW_BAR:.1f}x, ≥ {TOP_BAR:g}x, ≤ {TTFT_BAR:g}x, no failure): {fronts}."
        )
    else:
        served = [f"{r['front']} {r['requests_per_s']:.1f}" for r in rows if r["streams"] == top]
        compared = f"requests/s at {top} streams: {'; '.join(served)}."
    return [
        f"**The front at scale** ({run('scale', result)}, {result['workers']} simulated "
        f"engines, {result['rounds']} rounds): {compared}", "",
        f"![requests/s and TTFT p99 against streams]({SUMMARY_FIGURES['scale']})", "",
    ]  # fmt: skip


def routing_part(result: dict) -> list[str]:
    """Each routing policy's prefix-cache hit rate and TTFT p50 beside round-robin's."""
    lines = result["summary"]
    policies = list(dict.fromkeys(line["policy"] for line in lines))
    routed = [p for p in policies if p not in (BASELINE, IDEAL)]

    def span(policy: str, key: str, spec: str) -> str:
        values = [line[key] for line in lines if line["policy"] == policy and key in line]
        low, high = format(min(values), spec), format(max(values), spec)
        return low if low == high else f"{low} to {high}"

    each = "; ".join(
        f"{p} {span(p, 'hit_rate', '.1%')}, {span(p, 'ttft_p50_vs_round_robin', '.2f')}x"
        for p in routed
    )
    modes = listed(list(dict.fromkeys(line["mode"] for line in lines)))
    levels = listed([str(c) for c in dict.fromkeys(line["concurrency"] for line in lines)])
    return [
        f"**Routing by what each worker holds** ({run('routing', result)}, {result['rounds']} "
        f"rounds; {modes} at concurrency {levels}): prefix-cache hit rate, and TTFT p50 "
        f"against round-robin's: {each}; {BASELINE} {span(BASELINE, 'hit_rate', '.1%')}; "
        f"{IDEAL}, the ideal hit rate, {span(IDEAL, 'hit_rate', '.1%')}.", "",
        f"![prefix-cache hit rate and TTFT p50 by policy]({SUMMARY_FIGURES['routing']})", "",
    ]  # fmt: skip


def planners_part(records: dict[str, dict]) -> list[str]:
    """Each planner record's planners beside its best fixed split, by SLO attainment."""
    lines = [
        "**The planners on a step load**: SLO attainment (the share of requests within both "
        "goals), each planner beside the best fixed split of the same replicas:", "",
    ]  # fmt: skip
    for name, result in records.items():
        rows = result["rows"]
        fixed = max((r for r in rows if "fixed" in r["run"]), key=lambda r: r["attainment"])
        planners = ", ".join(
            f"{r['run']} {r['attainment']:.0%}" for r in rows if "planner" in r["run"]
        )
        lines.append(
            f"- {PLANNER_TITLES[name]} ({run(name, result)}): {planners}; best fixed split "
            f"({fixed['run']}) {fixed['attainment']:.0%}."
        )
    return [*lines, "", f"![SLO attainment of each run]({SUMMARY_FIGURES['planners']})", ""]
