"""bench/planner.py's section, for its simulated workers' record and for vLLM's: the
planner beside fixed splits on a step load."""

from __future__ import annotations

from bench.lib.sections.common import PLANNER_FIGURES, mean_replicas, notes_link


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
    lines += [*notes_link("planner-vllm.md" if real else "planner.md"), ""]
    return "\n".join(lines)


def planner_target(result: dict) -> str:
    return "bench-planner-vllm" if result["settings"].get("engine") == "vllm" else "bench-planner"


def planner_figure(result: dict) -> str:
    """The file name of bench/planner.py's figure: the simulated workers' or vLLM's."""
    real = result["settings"].get("engine") == "vllm"
    return PLANNER_FIGURES["planner_vllm" if real else "planner"]
