"""The section of bench/choices.py's record, bench/results/choices.json."""

from __future__ import annotations


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
