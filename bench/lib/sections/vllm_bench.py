"""bench/vllm_bench.py's section: vLLM's own benchmark client against each server."""

from __future__ import annotations


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
