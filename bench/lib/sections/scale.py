"""bench/scale.py's section: the fronts on simulated engines beside Dynamo's, against the
bars, and what a front node of more cores would serve."""

from __future__ import annotations

from dataclasses import dataclass

from bench.lib.sections.common import notes_link


def scale_section(result: dict) -> str:
    timing = result["timing"]
    lines = [
        "## The front at scale: simulated engines", "",
        f"Written by `make bench-scale` on {result['when']} ({result['machine']}). "
        f"{result['workers']} simulated engines behind each front (Prism: `prism front`, "
        "gateway and processor in one process: prism one, prism-xN N sharing the ports "
        "(`--front-workers N`), -iN with `--stream-interval N`, -split a gateway apart; "
        f"+ `prism worker --engine sim --sim-engines {result['workers']}`, all in one "
        "process, each its own replica; Dynamo 1.6.1: `dynamo.frontend` + `dynamo.mocker "
        f"--num-workers {result['workers']}` with the same timing as its profile): a step "
        f"takes {timing['decode_step_ms']} ms plus its prompt tokens at "
        f"{timing['prefill_tokens_per_s']:.0f} tokens/s, blocks of {timing['block_size']} "
        f"tokens, {timing['max_num_seqs']} sequences a step. Model {result['model']} "
        "(its tokenizer and chat template; no weights used). "
        f"{result['requests']} streaming chat requests per level, one new 64x48 PNG each, "
        f"{result['max_tokens']} tokens each; rounds: {result['rounds']} (medians). "
        "TTFT+ is the time to first token beyond one simulated step with the prompt: what "
        "the front and the engines' queues add. CPU: seconds of each front process per "
        "1000 requests, and of all the simulated engines together.", "",
        "| front | streams | req/s | TTFT+ p50 ms | TTFT+ p99 ms | TTFT p99 ms | ITL p99 ms "
        "| SSE events / request | CPU s / 1000 req | failures |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]  # fmt: skip
    for r in result["rows"]:
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_s_per_1000"].items())
        lines.append(
            f"| {r['front']} | {r['streams']} | {r['requests_per_s']:.1f} | "
            f"{r['ttft_added_ms_p50']:.1f} | {r['ttft_added_ms_p99']:.1f} | "
            f"{r['ttft_ms_p99']:.1f} | {r['itl_ms_p99']:.1f} | "
            f"{r.get('events_per_request', float('nan')):.1f} | {cpu} | {failures_cell(r)} |"
        )
    lines += scale_bars(result)
    lines += scale_model(result)
    lines += ["", *notes_link("scale.md"), ""]
    return "\n".join(lines)


# The bars against Dynamo: requests/s at least LOW_BAR of Dynamo's at the lowest level and
# TOP_BAR at the highest, TTFT p99 at most TTFT_BAR of Dynamo's at the highest, no failure.
LOW_BAR, TOP_BAR, TTFT_BAR = 1.0, 0.6, 2.0


@dataclass(frozen=True)
class Bars:
    """One Prism front against Dynamo's, at the lowest and highest level of streams."""

    front: str
    low: int
    top: int
    low_rps: float
    top_rps: float
    ttft: float
    failed: int

    @property
    def met(self) -> bool:
        return (
            self.low_rps >= LOW_BAR
            and self.top_rps >= TOP_BAR
            and self.ttft <= TTFT_BAR
            and not self.failed
        )


def front_bars(result: dict) -> list[Bars]:
    """Each Prism front of `result` (bench/scale.py's record) that the record has Dynamo's
    ratios for, against the bars."""
    rows = result["rows"]
    low, top = min(r["streams"] for r in rows), max(r["streams"] for r in rows)
    found = []
    for front in dict.fromkeys(r["front"] for r in rows if r["front"] != "dynamo"):
        low_rps = result.get(f"{front}_vs_dynamo_rps_ratio_s{low}")
        top_rps = result.get(f"{front}_vs_dynamo_rps_ratio_s{top}")
        ttft = result.get(f"{front}_vs_dynamo_ttft_p99_ratio_s{top}")
        if low_rps is None or top_rps is None or ttft is None:
            continue
        failed = sum(r["failures"] for r in rows if r["front"] == front)
        found.append(Bars(front, low, top, low_rps, top_rps, ttft, failed))
    return found


def scale_bars(result: dict) -> list[str]:
    """Each Prism front against the bars, a line each."""
    lines = [
        f"- {b.front}: {b.low_rps:.2f}x Dynamo's requests/s at {b.low} streams (bar "
        f"{LOW_BAR:.1f}), {b.top_rps:.2f}x at {b.top} (bar {TOP_BAR:g}), TTFT p99 {b.ttft:.2f}x "
        f"at {b.top} (bar {TTFT_BAR:g}), {b.failed} failed (bar 0): "
        f"{'met' if b.met else '**not met**'}."
        for b in front_bars(result)
    ]
    return ["", "Bars against Dynamo:", "", *lines] if lines else []


def scale_model(result: dict, cores: tuple[int, ...] = (8, 16, 32)) -> list[str]:
    """What a front node of more cores would serve, from the CPU per request each front
    took at the highest level: every core busy with fronts (Prism: a front process per
    core, `--front-workers`; Dynamo: its frontend's threads), engines elsewhere."""
    top = max(r["streams"] for r in result["rows"])
    fronts = {r["front"]: sum(v for k, v in r["cpu_s_per_1000"].items() if k != "engines")
              for r in result["rows"] if r["streams"] == top}  # fmt: skip
    if not fronts:
        return []
    names = list(fronts)
    lines = [
        "", f"Scaling model: requests/s a front node of N cores serves at most, N x 1000 / "
        f"(front CPU ms per request at {top} streams), the engines on other nodes:", "",
        "| cores | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names),
    ]  # fmt: skip
    for n in cores:
        lines.append(f"| {n} | " + " | ".join(f"{n * 1000 / fronts[f]:.0f}" for f in names) + " |")
    return lines


def failures_cell(row: dict, shown: int = 3) -> str:
    """A row's failures, with their `shown` commonest reasons and counts when it has any
    (records written before the reasons were kept have none)."""
    reasons = sorted((row.get("failure_reasons") or {}).items(), key=lambda rc: -rc[1])
    if not reasons:
        return str(row["failures"])
    text = "; ".join(f"{reason} x{count}" for reason, count in reasons[:shown])
    more = f"; {len(reasons) - shown} more" if len(reasons) > shown else ""
    # A reason is a server's words: a `|` in it would end the cell.
    return f"{row['failures']} ({text}{more})".replace("|", "\\|")
