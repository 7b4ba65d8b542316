"""bench/batch.py's section: batches beside interactive traffic, and `prism run-batch` beside
`vllm run-batch`."""

from __future__ import annotations

# The bar: interactive TTFT p99 beside a batch within this of its value without one.
BAR = 1.2


def batch_section(result: dict) -> str:
    beside = result["beside"]
    lines = [
        "## Batches beside interactive traffic",
        "",
        f"`bench/batch.py` (`make bench-batch`), {result['when']}, {result['machine']}, "
        f"{result['model']}, {result['mode']}: interactive chats (a 64x48 image each, streamed, "
        f"{result['max_tokens']} tokens) at {result['rate']:g}/s for {result['seconds']:g} s, "
        "alone; beside a large batch run by the Batch API (`--batch-concurrency` "
        f"{result['concurrency']}, `--batch-concurrency-beside` 2); beside the same chats "
        f"sent by {result['clients']} clients at once (a batch without the Batch API); and "
        f"the batch alone. Medians of {result['rounds']} rounds (bench/results/batch.json).",
        "",
        "| interactive requests | TTFT p50 ms | TTFT p99 ms | p99 / alone | batch lines/s |",
        "|---|---:|---:|---:|---:|",
        f"| alone | {beside['alone_ttft_ms_p50']:.1f} | {beside['alone_ttft_ms_p99']:.1f} | 1.00 "
        "| — |",
        f"| beside the Batch API's batch | {beside['batch_api_ttft_ms_p50']:.1f} | "
        f"{beside['batch_api_ttft_ms_p99']:.1f} | {beside['batch_api_p99_ratio']:.2f} | "
        f"{beside['batch_api_lines_per_s']:.1f} |",
        f"| beside {result['clients']} clients | {beside['clients_ttft_ms_p50']:.1f} | "
        f"{beside['clients_ttft_ms_p99']:.1f} | {beside['clients_p99_ratio']:.2f} | "
        f"{beside['clients_lines_per_s']:.1f} |",
        f"| (the batch alone) | | | | {beside['batch_alone_lines_per_s']:.1f} |",
        "",
        f"The bar, TTFT p99 within {BAR}x of alone beside the Batch API's batch: "
        f"{'met' if beside['batch_api_p99_ratio'] <= BAR else 'not met'}.",
        "",
    ]
    run = result.get("run_batch")
    if run:
        lines += [
            f"`prism run-batch` ({result['mode']}, `--batch-concurrency` {run['concurrency']}) "
            f"and `vllm run-batch` on one file of {run['lines']} image chats, each a whole "
            "command, engine start included, in turn: "
            f"{run['prism_s']:.1f} s against {run['vllm_s']:.1f} s (medians of "
            f"{len(run['seconds']['prism'])}); {run['same_answers']} of {run['lines']} answers "
            "the same (greedy).",
            "",
        ]
    return "\n".join(lines)
