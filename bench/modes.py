"""Latency of one request in each mode: time to first token and total, over HTTP.

    .venv/bin/python -m bench.modes --model DIR [--modes epd,e/pd,e/p/d,ep/d] [--reps 10]

For each mode, starts a mesh with `prism serve`'s launcher, warms it up, then sends the
same one-image chat request `--reps` times, one at a time, streaming with the OpenAI
SDK, and reports medians. The `epd` row is the anchor: the other modes' ratios are
against it. Not a test; results go to `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

from bench.lib.load import image_url
from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import LogConfig, ModelConfig
from prism.config.gateway import HttpConfig
from prism.modes import MODES
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.runtime.ports import free_port


def one_request(client: OpenAI, model: str, url: str, max_tokens: int) -> tuple[float, float]:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this image?"},
            ],
        }
    ]
    started = time.perf_counter()
    first = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    total = time.perf_counter() - started
    return (first or started) - started, total


def bench_mode(mode: str, model: str, reps: int, max_tokens: int, log_dir: Path) -> dict:
    port = free_port()
    config = MeshConfig(
        ModelConfig(model),
        ServeConfig(mode, grpc_port=0),
        HttpConfig(http_port=port),
        log=LogConfig("warning"),
    )
    mesh = Mesh.forking(plan(config))
    with open(log_dir / f"{mode.replace('/', '')}.log", "w") as log:
        mesh.start(timeout=300, log=log)
        try:
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            for seed in range(3):  # first requests pay handshakes and lazy setup
                one_request(client, model, image_url(100 + seed), max_tokens)
            # A new image each time, so the encoder's cache does not flatter E/PD and E/P/D.
            samples = [
                one_request(client, model, image_url(seed), max_tokens) for seed in range(reps)
            ]
        finally:
            mesh.stop()
    return {
        "mode": mode,
        "ttft_ms": 1000 * statistics.median(s[0] for s in samples),
        "total_ms": 1000 * statistics.median(s[1] for s in samples),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench/results/modes.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as logs:
        rows = [
            bench_mode(mode, args.model, args.reps, args.max_tokens, Path(logs))
            for mode in args.modes.split(",")
        ]
    anchor = rows[0]
    print(f"{'mode':<7}{'TTFT ms':>10}{'total ms':>10}{'TTFT/anchor':>13}{'total/anchor':>14}")
    for row in rows:
        row["ttft_ratio"] = row["ttft_ms"] / anchor["ttft_ms"]
        row["total_ratio"] = row["total_ms"] / anchor["total_ms"]
        print(
            f"{row['mode']:<7}{row['ttft_ms']:>10.1f}{row['total_ms']:>10.1f}"
            f"{row['ttft_ratio']:>13.2f}{row['total_ratio']:>14.2f}"
        )
    result = {
        "model": args.model,
        "reps": args.reps,
        "max_tokens": args.max_tokens,
        "statistic": "median",
        "anchor": anchor["mode"],
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
