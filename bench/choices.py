"""Several choices of one request (`n`), beside `vllm serve`: what n = 4 costs over n = 1.

    .venv/bin/python -m bench.choices --model DIR [--modes epd,e/p/d] [--n 4]
        [--requests 8] [--rounds 2] [--max-tokens 32] [--out JSON] [--doc docs/benchmarks.md]

Prism runs each choice as a request of its own (in P/D: its own prefill and KV hand-off),
as vLLM's engine runs each child of a request with n > 1. Per server, one request at a
time, each with a prompt of its own (about 1000 tokens and an image): `--requests` with
n = 1, then as many with n = `--n`, sampled with a seed; A B C A B C for `--rounds`.
Reported: latency p50 (first byte to last), TTFT p50, and the ratio of n's latency to one
choice's. Not a test: results go to `--out` (bench/results/choices.json), and `--doc` is
rendered again from the results files with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.load import image_url
from bench.lib.report import publish
from bench.lib.results import RECORDS, save
from bench.lib.servers import start_prism, start_vllm
from bench.lib.text import words

ANCHOR = "vllm serve"


def body(model: str, tag: str, n: int, max_tokens: int) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image_url(hash(tag) % 1000)}},
               {"type": "text", "text": words(tag, 760)}]  # fmt: skip
    return {"model": model, "messages": [{"role": "user", "content": content}], "n": n,
            "temperature": 1.0, "seed": 1, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip


async def timed(session: aiohttp.ClientSession, url: str, payload: dict) -> tuple[float, float]:
    """(TTFT, latency) of one streamed request, in seconds; checks every choice came."""
    started = time.perf_counter()
    first = None
    finished = set()
    async with session.post(url, json=payload) as reply:
        reply.raise_for_status()
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                if first is None and choice["delta"].get("content"):
                    first = time.perf_counter()
                if choice.get("finish_reason"):
                    finished.add(choice["index"])
    if len(finished) != payload["n"]:
        raise RuntimeError(f"{len(finished)} of {payload['n']} choices finished")
    return (first or started) - started, time.perf_counter() - started


async def run(base_url: str, model: str, tag: str, args: argparse.Namespace) -> dict:
    url = f"{base_url}/v1/chat/completions"
    row = {}
    async with aiohttp.ClientSession() as session:
        await timed(session, url, body(model, f"{tag}-warm", 1, 4))
        for n in (1, args.n):
            samples = [await timed(session, url, body(model, f"{tag}-{n}-{i}", n, args.max_tokens))
                       for i in range(args.requests)]  # fmt: skip
            row[f"n{n}_ttft_ms_p50"] = statistics.median(s[0] for s in samples) * 1000
            row[f"n{n}_latency_ms_p50"] = statistics.median(s[1] for s in samples) * 1000
    row["latency_ratio"] = row[f"n{args.n}_latency_ms_p50"] / row["n1_latency_ms_p50"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/p/d")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RECORDS["choices"])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    names = [ANCHOR, *args.modes.split(",")]
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    logs = Path(tempfile.mkdtemp(prefix="prism-choices-"))
    for round_index in range(args.rounds):
        for name in names:
            log = logs / f"{name.replace('/', '')}-{round_index}.log"
            server = (start_vllm(args.model, log, {"image": 1}) if name == ANCHOR
                      else start_prism(name, args.model, log))  # fmt: skip
            try:
                tag = f"r{round_index}-{name}"
                rounds[name].append(asyncio.run(run(server.base_url, args.model, tag, args)))
            finally:
                for stop in server.stop:
                    stop()
    rows = []
    for name, runs in rounds.items():
        row = {"server": name}
        for key in runs[0]:
            row[key] = statistics.median(run[key] for run in runs)
        rows.append(row)
    result = {"when": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs, "
              f"{platform.machine()}", "model": Path(args.model).name, "n": args.n,
              "requests": args.requests, "rounds": args.rounds, "max_tokens": args.max_tokens,
              "rows": rows}  # fmt: skip
    save(args.out, result)
    publish(args.doc, {"choices": result})
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
