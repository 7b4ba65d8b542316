"""Batches beside interactive traffic, and `prism run-batch` beside `vllm run-batch`.

    .venv/bin/python -m bench.batch --model DIR [--mode epd] [--rate 8] [--seconds 20]
        [--rounds 3] [--clients 8] [--concurrency 8] [--run-batch-lines 512]
        [--run-batch-rounds 2] [--run-batch-concurrency 8]
        [--out JSON] [--doc docs/benchmarks.md]

Part one, on one mesh: interactive chats (an image and a question each, streamed, 16 tokens,
greedy) arrive at a fixed `--rate` for `--seconds`, timed to their first token:
  - alone;
  - beside a large batch run by the Batch API (chats of the same shape, more than the window
    can answer), which starts lines only while no interactive request is in flight;
  - beside the same chats sent by `--clients` clients at once, as a batch sent without a
    Batch API would be (what the Batch API's yielding is measured against);
  - and the batch alone, for its capacity (lines/s).
Reported: interactive TTFT p50 and p99 each way and their ratio to alone (the bar: p99 within
1.2x), and the batch's lines/s beside the interactive load and alone; medians of `--rounds`
rounds, the four phases in turn in each.

Part two: one file of `--run-batch-lines` image chats through `prism run-batch` and `vllm
run-batch` (each a whole command: the engine's start included), in turn, `--run-batch-rounds`
times; seconds each (median) and whether every answer is the same.
Not a test: results go to `--out` (bench/results/batch.json); `--doc` is rendered again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.load import ServerFailed, one, requests
from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.servers import VLLM_ENV, start_prism
from bench.lib.stats import percentile
from prism.config.gateway import GatewayConfig

MAX_TOKENS = 16
# Seeds apart for each phase and round: no image is sent twice (no cache hit).
SEEDS_PER_PHASE = 100_000


def batch_line(body: dict, custom_id: str) -> str:
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body})  # fmt: skip


async def interactive(session: aiohttp.ClientSession, url: str, bodies: list[dict],
                      rate: float) -> list[float]:  # fmt: skip
    """Sends `bodies` at `rate` a second, each on time whatever the others do; TTFTs in ms."""
    started = time.perf_counter()

    async def at(i: int, body: dict) -> float:
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        return (await one(session, url, body)).ttft * 1000

    return list(await asyncio.gather(*(at(i, body) for i, body in enumerate(bodies))))


async def counts(session: aiohttp.ClientSession, base_url: str, batch_id: str) -> int:
    async with session.get(f"{base_url}/v1/batches/{batch_id}") as reply:
        done = (await reply.json())["request_counts"]
    return done["completed"] + done["failed"]


async def open_batch(session: aiohttp.ClientSession, base_url: str, lines: list[str]) -> str:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", ("\n".join(lines) + "\n").encode(), filename="batch.jsonl")
    async with session.post(f"{base_url}/v1/files", data=form) as reply:
        file_id = (await reply.json())["id"]
    create = {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
              "completion_window": "24h"}  # fmt: skip
    async with session.post(f"{base_url}/v1/batches", json=create) as reply:
        return (await reply.json())["id"]


async def end_batch(session: aiohttp.ClientSession, base_url: str, batch_id: str) -> None:
    async with session.post(f"{base_url}/v1/batches/{batch_id}/cancel") as reply:
        reply.raise_for_status()
    while True:
        async with session.get(f"{base_url}/v1/batches/{batch_id}") as reply:
            if (await reply.json())["status"] == "cancelled":
                return
        await asyncio.sleep(0.2)


async def with_batch_api(session, base_url: str, chats: list[dict], batch: list[dict],
                         rate: float, window: float) -> tuple[list[float], float]:  # fmt: skip
    """Interactive TTFTs beside a batch (none if `chats` is empty: the batch alone, for
    `window` seconds); the batch's lines/s meanwhile."""
    batch_id = await open_batch(session, base_url,
                                [batch_line(b, f"b{i}") for i, b in enumerate(batch)])  # fmt: skip
    # Under way before the window opens.
    while await counts(session, base_url, batch_id) < 8:
        await asyncio.sleep(0.05)
    before, started = await counts(session, base_url, batch_id), time.perf_counter()
    if chats:
        ttfts = await interactive(session, f"{base_url}/v1/chat/completions", chats, rate)
    else:
        ttfts = []
        await asyncio.sleep(window)
    lines_per_s = (await counts(session, base_url, batch_id) - before) / (
        time.perf_counter() - started
    )
    await end_batch(session, base_url, batch_id)
    return ttfts, lines_per_s


async def with_clients(session, url: str, chats: list[dict], batch: list[dict], rate: float,
                       clients: int) -> tuple[list[float], float]:  # fmt: skip
    """Interactive TTFTs beside `clients` clients sending the batch's chats as they can."""
    queue, done = list(batch), [0]
    stop = asyncio.Event()

    async def client() -> None:
        while queue and not stop.is_set():
            await one(session, url, {**queue.pop(), "stream": True})
            done[0] += 1

    running = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.sleep(1.0)
    before, started = done[0], time.perf_counter()
    ttfts = await interactive(session, url, chats, rate)
    lines_per_s = (done[0] - before) / (time.perf_counter() - started)
    stop.set()
    await asyncio.gather(*running)
    return ttfts, lines_per_s


async def round_of(base_url: str, model: str, args: argparse.Namespace, first_seed: int) -> dict:
    url = f"{base_url}/v1/chat/completions"
    count = int(args.rate * args.seconds)
    # More than the window can answer: the batch is never short of lines.
    lines = count * 40

    def seeds(phase: int, n: int) -> range:
        start = first_seed + phase * SEEDS_PER_PHASE
        return range(start, start + n)

    timeout, connector = aiohttp.ClientTimeout(total=900), aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, url, b) for b in requests(model, seeds(9, 8), 4)))
        alone = await interactive(session, url, requests(model, seeds(0, count), MAX_TOKENS),
                                  args.rate)  # fmt: skip
        beside_api, api_rate = await with_batch_api(
            session, base_url, requests(model, seeds(1, count), MAX_TOKENS),
            requests(model, seeds(2, lines), MAX_TOKENS), args.rate, args.seconds)  # fmt: skip
        beside_clients, clients_rate = await with_clients(
            session, url, requests(model, seeds(3, count), MAX_TOKENS),
            requests(model, seeds(4, lines), MAX_TOKENS), args.rate, args.clients)  # fmt: skip
        _, capacity = await with_batch_api(session, base_url, [],
                                           requests(model, seeds(5, lines), MAX_TOKENS), 0,
                                           args.seconds)  # fmt: skip
    row = {"batch_api_lines_per_s": api_rate, "clients_lines_per_s": clients_rate,
           "batch_alone_lines_per_s": capacity}  # fmt: skip
    for name, ttfts in (("alone", alone), ("batch_api", beside_api), ("clients", beside_clients)):
        row[f"{name}_ttft_ms_p50"] = percentile(ttfts, 50)
        row[f"{name}_ttft_ms_p99"] = percentile(ttfts, 99)
    for name in ("batch_api", "clients"):
        row[f"{name}_p99_ratio"] = row[f"{name}_ttft_ms_p99"] / row["alone_ttft_ms_p99"]
    return row


def beside_interactive(args: argparse.Namespace, logs: Path) -> dict:
    server = start_prism(args.mode, args.model, logs / "mesh.log",
                         gateway=GatewayConfig(batch_store=str(logs / "batches"),
                                               batch_concurrency=args.concurrency))  # fmt: skip
    try:
        rounds = [asyncio.run(round_of(server.base_url, args.model, args, 10 * SEEDS_PER_PHASE * r))
                  for r in range(args.rounds)]  # fmt: skip
    finally:
        for stop in server.stop:
            stop()
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} | {
        "rounds": rounds
    }


def run_batch_argv(tool: str, given: Path, written: Path, model: str, args) -> list[str]:
    if tool == "prism":
        return [sys.executable, "-m", "prism.cli", "--log-level", "warning", "run-batch",
                "-i", str(given), "-o", str(written), "--model", model, "--mode", args.mode,
                "--batch-concurrency", str(args.run_batch_concurrency)]  # fmt: skip
    return [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(given),
            "-o", str(written), "--model", model, "--dtype", "float32", "--enforce-eager",
            "--seed", "0", "--limit-mm-per-prompt", json.dumps({"image": 1})]  # fmt: skip


def answers(path: Path) -> dict[str, str]:
    entries = [json.loads(text) for text in path.read_text().splitlines()]
    return {e["custom_id"]: e["response"]["body"]["choices"][0]["message"]["content"]
            for e in entries if e["response"] and e["response"].get("body")}  # fmt: skip


def side_by_side(args: argparse.Namespace, logs: Path) -> dict:
    given = logs / "run-batch.jsonl"
    bodies = requests(args.model, range(7_000_000, 7_000_000 + args.run_batch_lines), MAX_TOKENS)
    given.write_text("\n".join(batch_line(b, f"r{i}") for i, b in enumerate(bodies)) + "\n")
    seconds: dict[str, list[float]] = {"prism": [], "vllm": []}
    written: dict[str, dict[str, str]] = {}
    for round_index in range(args.run_batch_rounds):
        for tool in seconds:
            out = logs / f"{tool}-{round_index}.jsonl"
            started = time.perf_counter()
            with open(logs / f"{tool}-{round_index}.log", "w") as log:
                subprocess.run(run_batch_argv(tool, given, out, args.model, args), check=True,
                               stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **VLLM_ENV})  # fmt: skip
            seconds[tool].append(time.perf_counter() - started)
            written[tool] = answers(out)
    same = sum(written["prism"].get(k) == v for k, v in written["vllm"].items())
    return {"lines": args.run_batch_lines, "prism_s": statistics.median(seconds["prism"]),
            "vllm_s": statistics.median(seconds["vllm"]), "seconds": seconds,
            "answered": {tool: len(got) for tool, got in written.items()},
            "same_answers": same, "concurrency": args.run_batch_concurrency}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="epd")
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="the mesh's --batch-concurrency")
    parser.add_argument("--run-batch-lines", type=int, default=512)
    parser.add_argument("--run-batch-rounds", type=int, default=2)
    parser.add_argument("--run-batch-concurrency", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RECORDS["batch"])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-batch-"))
    try:
        beside = beside_interactive(args, logs)
    except ServerFailed as exc:
        raise SystemExit(f"the mesh failed a request: {exc}") from None
    result = {**stamp(), "model": args.model, "mode": args.mode, "rate": args.rate,
              "seconds": args.seconds, "clients": args.clients, "rounds": args.rounds,
              "max_tokens": MAX_TOKENS, "concurrency": args.concurrency, "beside": beside,
              "run_batch": side_by_side(args, logs) if args.run_batch_rounds else None}  # fmt: skip
    save(args.out, result)
    publish(args.doc, {"batch": result})
    print(
        json.dumps(
            {k: v for k, v in result.items() if k != "beside"}
            | {"beside": {k: v for k, v in beside.items() if k != "rounds"}},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
