"""docs/benchmarks.md, the one page of the benchmarks, rendered from their results files
(bench/results/, bench.lib.results.RECORDS) and the notes written by hand beside each
section (bench/notes/): each section in markdown from its result, and the page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib.plots import FIGURES, draw, draw_replicas
from bench.lib.results import records
from bench.lib.shapes import (
    ANCHOR,
    ANCHORS,
    ANSWER_WORDS,
    AUDIO_RATE,
    AUDIO_SECONDS,
    QUESTION_WORDS,
    SAME_ENGINE,
    SYSTEM_WORDS,
    TAX,
    VIDEO_FPS,
    VIDEO_FRAMES,
    slug,
)
from bench.lib.stats import shape_pairs, suffix

# What the results show and why, written by hand: one file per section that has notes.
NOTES = Path(__file__).resolve().parents[1] / "notes"


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


# The goals of docs/benchmarks.md, each checked where it was measured.
RPS_GOAL, TTFT_GOAL_MS, TAX_GOAL = 1.0, 2.0, 0.8


def anchors_section(result: dict) -> str:
    """Each Prism mode beside the anchors of its shape, and the disaggregation tax."""
    names = {ANCHOR: "vllm serve", "dynamo_agg": "Dynamo aggregated", "dynamo_pd": "Dynamo P/D",
             "dynamo_e_pd": "Dynamo E/PD", "vllm_pd": "vLLM P/D (NixlConnector + proxy)",
             "epd": "Prism EPD"}  # fmt: skip
    levels = sorted({r["concurrency"] for r in result["rows"]})
    top = max(levels)
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
    for mode, other in shape_pairs(result["rows"]):
        # `vllm serve` is of EPD's shape alone.
        if other == ANCHOR and mode != "epd":
            continue
        name = f"{slug(mode)}_vs_{slug(other)}"
        rps = [result.get(f"{name}_rps_ratio{suffix(c, top)}") for c in levels]
        ttft = [result.get(f"{slug(mode)}_minus_{slug(other)}_ttft_p50_ms{suffix(c, top)}")
                for c in levels]  # fmt: skip
        if mode in TAX and other in TAX[mode]:
            goal = f"req/s at c={top} ≥ {TAX_GOAL:.1f}x EPD"
            met = rps[-1] is not None and rps[-1] >= TAX_GOAL
        else:
            goal = (
                f"req/s at c={top} ≥ {RPS_GOAL:.1f}x; "
                f"TTFT p50 at c={levels[0]} ≤ +{TTFT_GOAL_MS:g} ms"
            )
            met = (rps[-1] or 0) >= RPS_GOAL and (
                ttft[0] if ttft[0] is not None else 1e9
            ) <= TTFT_GOAL_MS
        lines.append(
            f"| {mode} | {names.get(other, other)} | "
            + " | ".join("" if v is None else f"{v:.2f}" for v in rps)
            + " | "
            + " | ".join("" if v is None else f"{v:+.1f}" for v in ttft)
            + f" | {goal} | {'yes' if met else '**no**'} |"
        )
    if result.get("not_run"):
        lines += ["", "Not run here: " + "; ".join(result["not_run"]) + "."]
    lines += ["", (NOTES / "anchors.md").read_text()]
    return "\n".join(lines) + "\n"


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
    lines += ["", (NOTES / "scale.md").read_text()]
    lines.append("")
    return "\n".join(lines)


def scale_bars(result: dict) -> list[str]:
    """Each Prism front against the bars: requests/s at least Dynamo's at the lowest level
    and 0.6x at the highest, TTFT p99 at most 2x Dynamo's at the highest, no failure."""
    rows = result["rows"]
    low, top = min(r["streams"] for r in rows), max(r["streams"] for r in rows)
    lines = []
    for front in dict.fromkeys(r["front"] for r in rows if r["front"] != "dynamo"):
        low_rps = result.get(f"{front}_vs_dynamo_rps_ratio_s{low}")
        top_rps = result.get(f"{front}_vs_dynamo_rps_ratio_s{top}")
        ttft = result.get(f"{front}_vs_dynamo_ttft_p99_ratio_s{top}")
        if low_rps is None or top_rps is None or ttft is None:
            continue
        failed = sum(r["failures"] for r in rows if r["front"] == front)
        met = low_rps >= 1.0 and top_rps >= 0.6 and ttft <= 2.0 and not failed
        lines.append(
            f"- {front}: {low_rps:.2f}x Dynamo's requests/s at {low} streams (bar 1.0), "
            f"{top_rps:.2f}x at {top} (bar 0.6), TTFT p99 {ttft:.2f}x at {top} (bar 2), "
            f"{failed} failed (bar 0): {'met' if met else '**not met**'}."
        )
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


def routing_section(result: dict) -> str:
    lines = [
        "## Routing by what each worker holds",
        "",
        f"Written by `make bench-routing` on {result['when']} ({result['machine']}). Model: "
        f"{result['model']}. Two aggregated workers per mode, one core each; "
        f"{result['conversations']} conversations per run, {result['turns']} turns each "
        f"({result['requests']} streaming requests), so many conversations at a time as the "
        f"concurrency says; {result['max_tokens']} tokens generated per request. Each "
        f"conversation: a system prompt of its own of {SYSTEM_WORDS} words, an image shared "
        f"with one other conversation, a question of {QUESTION_WORDS} words a turn, each "
        f"sent with the conversation so far, answers of {ANSWER_WORDS} words included (about "
        "1.3 tokens a word). The policies run in turn on one mesh (its processor started "
        f"again with each), {result['rounds']} rounds; every run has conversations of its "
        "own. Medians over the rounds. Hit rate: prompt tokens vLLM served from its prefix "
        "cache over prompt tokens, both workers. One worker: the same load on a mesh of one "
        "worker, whose hit rate is the ideal. Busiest: the share of requests the busier "
        "worker served.",
        "",
        "| mode | concurrency | policy | prefix-cache hit rate | TTFT p50 ms | TTFT p99 ms "
        "| req/s | busiest | TTFT p50 vs round-robin |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for line in result["summary"]:
        ratio = line.get("ttft_p50_vs_round_robin")
        lines.append(
            f"| {line['mode']} | {line['concurrency']} | {line['policy']} "
            f"| {line['hit_rate']:.1%} | {line['ttft_ms_p50']:.1f} | {line['ttft_ms_p99']:.1f} "
            f"| {line['requests_per_s']:.2f} | {line['busiest_share']:.0%} "
            f"| {f'{ratio:.2f}' if ratio else ''} |"
        )
    return "\n".join(lines) + "\n"


def vllm_bench_section(result: dict) -> str:
    lines = [
        "## vLLM's benchmark client",
        "",
        f"`vllm bench serve` (vLLM's own client, unmodified), {result['when']}, "
        f"{result['machine']}, {result['model']}: {result['prompts']} random multimodal "
        f"chats (one 64x64 image, {result['input_len']} text tokens) at concurrency "
        f"{result['concurrency']}, {result['max_tokens']} output tokens with `--ignore-eos`, "
        "sampled (the client sends no temperature); each server "
        f"{result['rounds']} times, in turn (`bench/vllm_bench.py`, "
        "bench/results/vllm_bench.json).",
        "",
        "| server | round | completed | failed | requests/s | output tok/s | TTFT p50 ms "
        "| TTFT p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['server']} | {row['round']} | {row['completed']} | {row['failed']} | "
            f"{row['requests_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
            f"{row['ttft_ms_p50']:.0f} | {row['ttft_ms_p99']:.0f} |"
        )
    failures = [row for row in result["rows"] if row["errors"]]
    for row in failures:
        lines += ["", f"{row['server']}, round {row['round']}: " + "; ".join(row["errors"])]
    return "\n".join(lines) + "\n"


def choices_section(result: dict) -> str:
    """bench/choices.py's: n choices of one request beside one."""
    n = result["n"]
    lines = [
        "## Several choices of one request",
        "",
        f"Written by `make bench-choices` on {result['when']} ({result['machine']}). Model: "
        f"{result['model']}. One request at a time, {result['requests']} with n = 1, then "
        f"{result['requests']} with n = {n} (seeded sampling, {result['max_tokens']} tokens per "
        "choice), each with a prompt of its own (about 1000 tokens and a 64x48 image); "
        f"medians over {result['rounds']} rounds. Prism runs each choice as a request of its "
        "own: in E/P/D each gets its own prefill and KV hand-off.",
        "",
        f"| server | n=1 TTFT ms | n=1 latency ms | n={n} TTFT ms | "
        f"n={n} latency ms | n={n} / n=1 latency |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['server']} | {r['n1_ttft_ms_p50']:.1f} | {r['n1_latency_ms_p50']:.1f} | "
            f"{r[f'n{n}_ttft_ms_p50']:.1f} | {r[f'n{n}_latency_ms_p50']:.1f} | "
            f"{r['latency_ratio']:.2f} |"
            for r in result["rows"]
        ),
        "",
    ]
    return "\n".join(lines)


def loads_section(results: dict[str, dict[str, Any]]) -> list[str]:
    """The image load (with its figures and notes), then the video and audio loads, as
    lines."""
    lines = []
    if image := results.get("image"):
        lines += [setting(image, "one 64x48 image"), "", *table(image), ""]
        lines += [*(f"![{label}](benchmarks-{name}.png)" for _, label, name in FIGURES), ""]
        lines += [(NOTES / "image.md").read_text()]
    media = {
        "video": (
            f"one {VIDEO_FRAMES}-frame 64x48 MP4 video (MPEG-4, {VIDEO_FPS:g} frames a "
            "second, every frame taken by the model's video loader)"
        ),
        "audio": (
            f"one {AUDIO_SECONDS:g} s clip of noise (16-bit mono WAV at "
            f"{AUDIO_RATE // 1000} kHz, the model's rate) as an `input_audio` part"
        ),
    }
    for load, what in media.items():
        if result := results.get(load):
            lines += [f"## {load.capitalize()} load", "", setting(result, what), "",
                      *table(result), "", *resent_lines(load, result["resent"])]  # fmt: skip
    return lines


def resent_lines(load: str, resent: list[dict]) -> list[str]:
    if not resent:
        return []
    item = {"video": "video", "audio": "clip"}[load]
    return [
        f"**A {item} sent again.** Each of {resent[0]['requests']} new {item}s sent twice, "
        f"one request at a time, each sending under its own question asked before the "
        f"{item} (so the second shares no prompt prefix with the first past the chat "
        "template's); time to first token, p50:",
        "",
        "| server | first sending, ms | sent again, ms |",
        "|---|---:|---:|",
        *(
            f"| {r['server']} | {r['ttft_ms_p50_first']:.1f} | {r['ttft_ms_p50_repeat']:.1f} |"
            for r in resent
        ),
        "",
    ]


def planner_section(result: dict) -> str:
    settings = result["settings"]
    real = settings.get("engine", "sim") == "vllm"
    count = settings.get("warm_spares", 0)
    spares = f"; {count} warm spare a role, started and not serving until promoted" if count else ""
    workers = "real vLLM engines (the CPU build)"
    if not real:
        workers = (
            f"simulated workers ({settings['seqs']} sequences each, "
            f"{settings['step_ms']:g} ms a step)"
        )
    lines = [
        "## The planner on a step load" + (", real engines" if real else ""),
        "",
        f"Written by `make {planner_target(result)}` on {result['when']} ({result['machine']}). "
        f"Model: {result['model']}; E/PD on {workers}, encoders whose vision tower takes "
        f"{settings['encode_ms']:g} ms more per image (`--sim-encode-ms`). The load is open, "
        f"{settings['rate']:g} requests/s, in three phases of {settings['phase_s']:g} s: "
        f"text chats answered in {settings['text_tokens']} tokens, then requests with "
        f"{settings['images']} images answered in {settings['image_tokens']}, then text "
        f"again. Goals: time to first token {settings['ttft_slo_ms']:g} ms, mean time "
        f"between tokens {settings['itl_slo_ms']:g} ms. SLO attainment: the share of "
        "requests that met both (a failed one did not). Fixed runs: encoders+workers, "
        f"{settings['budget']} replicas in all; the planner starts from one of each within "
        f"the same budget (interval {settings.get('interval_s', 2):g} s, cool-down "
        f"{settings['cooldown_s']:g} s{spares}). Replicas, mean: those serving, sampled "
        "every second (warm spares not counted).",
        "",
        "| run | attainment | "
        + " | ".join(result["phases"])
        + " | req/s | failed | replicas, mean |",
        "|---|---:|" + "---:|" * len(result["phases"]) + "---:|---:|---:|",
    ]
    for row in result["rows"]:
        phases = " | ".join(
            f"{row[f'attainment_{n}_{p}']:.0%}" for n, p in enumerate(result["phases"])
        )
        lines.append(
            f"| {row['run']} | {row['attainment']:.0%} | {phases} "
            f"| {row['requests_per_s']:.2f} | {row['failed']} | {mean_replicas(row):.2f} |"
        )
    lines += [
        "",
        f"The planner's attainment is {result['planner_vs_best_fixed']:.2f}x the best fixed "
        f"split's ({result['best_fixed']}).",
        "",
        f"![replicas over time]({planner_figure(result)})",
        "",
    ]
    notes = NOTES / ("planner-vllm.md" if real else "planner.md")
    if notes.exists():
        lines.append(notes.read_text())
    return "\n".join(lines)


def mean_replicas(row: dict) -> float:
    """What a run cost: the replicas serving (warm spares not counted), every role's, on
    average over its samples."""
    samples = row["replicas"]
    serving = sum(v for s in samples for k, v in s.items() if k != "t")
    return serving / max(1, len(samples))


def planner_target(result: dict) -> str:
    return "bench-planner-vllm" if result["settings"].get("engine") == "vllm" else "bench-planner"


# Each planner record's figure, beside the page.
PLANNER_FIGURES = {
    "planner": "benchmarks-planner.png",
    "planner_vllm": "benchmarks-planner-vllm.png",
    "planner_dynamo": "benchmarks-planner-dynamo.png",
}


def planner_figure(result: dict) -> str:
    """The file name of bench/planner.py's figure: the simulated workers' or vLLM's."""
    real = result["settings"].get("engine") == "vllm"
    return PLANNER_FIGURES["planner_vllm" if real else "planner"]


def planner_dynamo_section(result: dict) -> str:
    """bench/planner_dynamo.py's: Prism's planner and Dynamo's on one P/D step load."""
    settings, timing = result["settings"], result["timing"]
    phases = result["phases"]
    lines = [
        "## The planner on a P/D step load, beside Dynamo's", "",
        f"Written by `make bench-planner-dynamo` on {result['when']} ({result['machine']}). "
        f"Model: {result['model']} (its tokenizer; no weights used). Prefill and decode "
        "engines simulated with one timing on both sides: a step takes "
        f"{timing['decode_step_ms']:g} ms plus its prompt tokens at "
        f"{timing['prefill_tokens_per_s']:g} tokens/s (at most "
        f"{timing['max_num_batched_tokens']} a step), each engine's KV cache "
        f"{timing['kv_blocks']} blocks of {timing['block_size']} tokens. Prism: `prism serve "
        "--mode ep/d --engine sim` (text alone, EP/D is P/D). NVIDIA Dynamo 1.6.1: "
        "`dynamo.frontend` (round-robin, as Prism routes; request migration on, limit "
        f"{settings['dynamo_migration']}) before `dynamo.mocker` workers of that timing, one "
        "engine a process. The load is open (Poisson arrivals), three phases of "
        f"{settings['phase_s']:g} s: prompts of {settings['long_words']} words (about "
        f"{1.4 * settings['long_words']:.0f} tokens) answered in {settings['short_tokens']} "
        f"tokens at {settings['prompt_rate']:g} requests/s, then prompts of "
        f"{settings['short_words']} words answered in {settings['long_tokens']} at "
        f"{settings['answer_rate']:g}/s, then the long prompts again. Goals: time to first "
        f"token {settings['ttft_slo_ms'] / 1000:g} s, mean time between tokens "
        f"{settings['itl_slo_ms']:g} ms; attainment: the share of requests that met both (a "
        "failed one did not). The client leaves a request once it can no longer meet both "
        "(the TTFT goal and the ITL goal for every token it asked for, plus a second): "
        "abandoned, a miss and not a failure, as a user would leave; a backlog's requests "
        f"end there rather than in a tail that outlasts the load. Budget: {settings['budget']} "
        "replicas, prefill and decode "
        "together; fixed runs are Prism's (PREFILL+DECODE); both planners start from one of "
        "each. Prism's planner: interval "
        f"{settings['interval_s']:g} s, cool-down {settings['cooldown_s']:g} s, "
        f"{settings['warm_spares']} warm spares. Dynamo's planner (`python -m dynamo.planner`, "
        "`optimization_target: load`, `environment: virtual`; bench/dynamo_scaler.py starts "
        "and stops its workers as its operator would): every "
        f"{settings['dynamo_interval_s']} s, prefill one more at "
        f"{settings['dynamo_prefill_up']} prompt tokens queued at an engine, one fewer at "
        f"{settings['dynamo_prefill_down']} or less at all; decode one more at "
        f"{settings['dynamo_decode_up']:g} % of an engine's KV cache used (running and "
        f"queued), one fewer at {settings['dynamo_decode_down']:g} % or less at all. "
        "Replicas, mean: those serving, sampled every second.", "",
        "| run | attainment | " + " | ".join(phases) + " | TTFT p90 s, answered, by phase "
        "| ITL p90 ms, answered, by phase | req/s | failed | abandoned | replicas, mean |",
        "|---|---:|" + "---:|" * len(phases) + "---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for row in result["rows"]:
        lines.append(
            f"| {row['run']} | {row['attainment']:.0%} | "
            + " | ".join(f"{row[f'attainment_{n}_{p}']:.0%}" for n, p in enumerate(phases))
            + f" | {by_phase(row, 'ttft_s', phases, 1)} | {by_phase(row, 'itl_s', phases, 1000)} "
            f"| {row['requests_per_s']:.2f} | {row['failed']} | {row.get('abandoned', 0)} "
            f"| {mean_replicas(row):.2f} |"
        )
    lines += ["", f"![replicas over time]({PLANNER_FIGURES['planner_dynamo']})", ""]
    notes = NOTES / "planner-dynamo.md"
    if notes.exists():
        lines.append(notes.read_text())
    return "\n".join(lines)


def by_phase(row: dict, goal: str, phases: list[str], scale: float) -> str:
    """A goal's 90th percentile in each phase, `a / b / c` (a dash where none answered)."""
    values = [row.get(f"{goal}_p90_{n}_{p}") for n, p in enumerate(phases)]
    digits = 1 if scale == 1 else 0
    return " / ".join("-" if v is None else f"{v * scale:.{digits}f}" for v in values)


# The sections after the loads', in the page's order, by the record each renders.
SECTIONS = {
    "anchors": anchors_section,
    "scale": scale_section,
    "routing": routing_section,
    "planner": planner_section,
    "planner_vllm": planner_section,
    "planner_dynamo": planner_dynamo_section,
    "choices": choices_section,
    "vllm_bench": vllm_bench_section,
}


def page(results: dict[str, dict[str, Any]]) -> str:
    """docs/benchmarks.md from `results` (by record name): a section per record there."""
    lines = ["# Benchmarks: Prism against `vllm serve`", "", *loads_section(results)]
    lines += [render(results[name]) for name, render in SECTIONS.items() if name in results]
    return "\n".join(lines)


def publish(doc: Path, latest: dict[str, dict[str, Any]] | None = None) -> None:
    """Renders `doc` from the results files, with `latest` (a run's results, by record
    name) in place of theirs, and draws the image load's figures beside it."""
    shown = records() | (latest or {})
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(page(shown))
    if "image" in shown:
        draw(doc.parent, shown["image"]["rows"])
    for name, figure in PLANNER_FIGURES.items():
        if name in shown:
            draw_replicas(doc.parent / figure, shown[name])
