"""The section of bench/planner_dynamo.py's record, bench/results/planner-dynamo.json,
and its cells."""

from __future__ import annotations

from bench.lib.sections.common import PLANNER_FIGURES, mean_replicas, notes_link


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
    lines += [*notes_link("planner-dynamo.md"), ""]
    return "\n".join(lines)


def by_phase(row: dict, goal: str, phases: list[str], scale: float) -> str:
    """A goal's 90th percentile in each phase, `a / b / c` (a dash where none answered)."""
    values = [row.get(f"{goal}_p90_{n}_{p}") for n, p in enumerate(phases)]
    digits = 1 if scale == 1 else 0
    return " / ".join("-" if v is None else f"{v * scale:.{digits}f}" for v in values)
