"""bench/routing.py's section: each routing policy's prefix-cache hits and times."""

from __future__ import annotations

from bench.lib.shapes import ANSWER_WORDS, QUESTION_WORDS, SYSTEM_WORDS


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
