"""Routing policies side by side on multi-turn image chats: vLLM's prefix-cache hit rate,
time to first token and requests/s on two aggregated workers, and on one as the ideal.

    .venv/bin/python -m bench.routing --model DIR [--modes epd,e/pd]
        [--policies round-robin,least-loaded,kv] [--rounds 2] [--conversations 24]
        [--turns 4] [--concurrency 4,8] [--max-tokens 8] [--out JSON]
        [--doc docs/benchmarks.md]

Per mode, one mesh of two workers serves every policy: its processor starts again with each
(`Mesh.restart`), the policies in turn at each concurrency level, A B C A B C for
`--rounds`. Every run has conversations of its own, so that none finds what an earlier run
left in a cache. A conversation: a long system prompt of its own, an image (two
conversations share each image) and `--turns` questions, each sent with the whole
conversation so far once the answer to the one before has come; `--concurrency`
conversations at a time. Per run: the workers' prefix-cache hit rate (prompt tokens served
from the cache / prompt tokens, from vLLM's counters, both workers together), TTFT p50 and
p99, requests/s. The ideal: the same load on a mesh of one worker, where every block is in
the one cache. Not a test: results go to `--out` (bench/results/routing.json), and `--doc`
is rendered again from the results files with them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.load import Sample, image_url, one
from bench.lib.metrics import counter
from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.sections.routing import routing_section
from bench.lib.shapes import ANSWER_WORDS, QUESTION_WORDS, SYSTEM_WORDS
from bench.lib.stats import percentile
from bench.lib.text import words
from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import LimitConfig, LogConfig, ModelConfig
from prism.config.gateway import HttpConfig
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.runtime.ports import free_port

IDEAL = "one worker"


def conversations(run: int, count: int, turns: int) -> list[list[tuple[object, str]]]:
    """Each conversation's system prompt, then each turn's question and answer (the first
    question with its image)."""
    out = []
    for c in range(count):
        turn = []
        for t in range(turns):
            ask: object = words(f"{run} {c} {t} question", QUESTION_WORDS)
            if not t:
                image = {
                    "type": "image_url",
                    "image_url": {"url": image_url(run * 10_000 + c // 2)},
                }
                ask = [image, {"type": "text", "text": ask}]
            turn.append((ask, words(f"{run} {c} {t} answer", ANSWER_WORDS)))
        out.append([(words(f"{run} {c} system", SYSTEM_WORDS), ""), *turn])
    return out


async def converse(
    session: aiohttp.ClientSession, url: str, model: str, turns: list, max_tokens: int
) -> list[Sample]:
    """One conversation, a turn at a time, each with the history. The answers in it are
    the load's, not the model's: a random-weight model's are noise of `max_tokens` tokens."""
    (system, _), *asks = turns
    messages: list[dict] = [{"role": "system", "content": system}]
    samples = []
    for ask, answer in asks:
        messages.append({"role": "user", "content": ask})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        samples.append(await one(session, url, body))
        messages.append({"role": "assistant", "content": answer})
    return samples


async def drive(base_url: str, model: str, load: list, concurrency: int, max_tokens: int) -> dict:
    url = f"{base_url}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        queue = list(reversed(load))
        samples: list[Sample] = []

        async def user() -> None:
            while queue:
                samples.extend(await converse(session, url, model, queue.pop(), max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = [s.ttft * 1000 for s in samples]
    return {
        "requests": len(samples),
        "seconds": elapsed,
        "requests_per_s": len(samples) / elapsed,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
    }


def engine_counters(mesh: Mesh) -> dict[str, list[float]]:
    """Per worker: prompt tokens served from the prefix cache, prompt tokens, requests."""
    names = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:request_success_total")  # fmt: skip
    workers = [s for s in mesh.stages if s.name.startswith("worker")]
    return {name: [counter(s.metrics_url, name) for s in workers] for name in names}


def run(mesh: Mesh, base_url: str, args: argparse.Namespace, concurrency: int, number: int) -> dict:
    load = conversations(number, args.conversations, args.turns)
    # Connections and lazy set-up, outside the measurement, on conversations of its own.
    warm_up = conversations(1000 + number, 2, 1)
    asyncio.run(drive(base_url, args.model, warm_up, 2, args.max_tokens))
    before = engine_counters(mesh)
    row = asyncio.run(drive(base_url, args.model, load, concurrency, args.max_tokens))
    grown = {
        name: [a - b for a, b in zip(values, before[name], strict=True)]
        for name, values in engine_counters(mesh).items()
    }
    hits, queries = (sum(grown[f"vllm:prefix_cache_{n}_total"]) for n in ("hits", "queries"))
    row["hit_rate"] = hits / max(queries, 1)
    # How evenly the requests spread: the busiest worker's share.
    served = grown["vllm:request_success_total"]
    row["busiest_share"] = max(served) / max(sum(served), 1)
    return row


def with_policy(argv: list[str], policy: str) -> list[str]:
    at = argv.index("--routing") + 1
    return [*argv[:at], policy, *argv[at + 1 :]]


def bench_mode(
    mode: str, args: argparse.Namespace, levels: list[int], logs: Path, first_run: int
) -> list[dict]:
    """Every policy on two workers at every level, `--rounds` times in turn; then one
    worker."""
    rows = []
    for workers, policies in ((2, args.policies.split(",")), (1, [IDEAL])):
        port = free_port()
        # One front: each policy restarts it.
        serve = ServeConfig(mode, workers=workers, grpc_port=0, front_workers=1)
        config = MeshConfig(ModelConfig(args.model), serve, HttpConfig(http_port=port),
                            limit=LimitConfig(0),
                            log=LogConfig("warning"))  # fmt: skip
        mesh = Mesh.forking(plan(config))
        base_url = f"http://127.0.0.1:{port}"
        with open(logs / f"{mode.replace('/', '_')}-{workers}.log", "w") as log:
            mesh.start(timeout=300, log=log)
            try:
                for round_ in range(args.rounds if workers == 2 else 1):
                    for concurrency, policy in itertools.product(levels, policies):
                        if policy != IDEAL:
                            argv = with_policy(mesh.stage("front").argv, policy)
                            mesh.restart("front", argv, log=log)
                        first_run += 1
                        row = run(mesh, base_url, args, concurrency, first_run)
                        row |= {"mode": mode, "policy": policy, "round": round_,
                                "concurrency": concurrency}  # fmt: skip
                        rows.append(row)
                        print(f"{mode:>5} {policy:>13} c={concurrency} round {round_}: hit "
                              f"rate {row['hit_rate']:.1%}, TTFT p50 {row['ttft_ms_p50']:.1f} "
                              f"ms, p99 {row['ttft_ms_p99']:.1f} ms, "
                              f"{row['requests_per_s']:.2f} req/s, busiest worker "
                              f"{row['busiest_share']:.0%}", flush=True)  # fmt: skip
            finally:
                mesh.stop()
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per mode, level and policy, the median of each measure over the rounds, and TTFT
    p50 against round-robin's of the same round."""
    out = []
    for mode, concurrency, policy in dict.fromkeys(
        (r["mode"], r["concurrency"], r["policy"]) for r in rows
    ):
        where = (mode, concurrency)
        runs = [r for r in rows if (r["mode"], r["concurrency"], r["policy"]) == (*where, policy)]
        line = {"mode": mode, "concurrency": concurrency, "policy": policy, "rounds": len(runs)}
        for key in ("hit_rate", "ttft_ms_p50", "ttft_ms_p99", "requests_per_s", "busiest_share"):
            line[key] = percentile([r[key] for r in runs], 50)
        against = [
            r["ttft_ms_p50"] / rr["ttft_ms_p50"]
            for r in runs
            for rr in rows
            if (rr["mode"], rr["concurrency"], rr["policy"], rr["round"])
            == (*where, "round-robin", r["round"])
        ]
        if against and policy != IDEAL:
            line["ttft_p50_vs_round_robin"] = percentile(against, 50)
        out.append(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd")
    parser.add_argument("--policies", default="round-robin,least-loaded,kv")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", default="4,8")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RECORDS["routing"])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-routing-"))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict] = []
    for number, mode in enumerate(args.modes.split(",")):
        rows += bench_mode(mode, args, levels, logs, first_run=number * 100)
    result = {
        **stamp(),
        "model": args.model,
        "conversations": args.conversations,
        "turns": args.turns,
        "requests": args.conversations * args.turns,
        "concurrency": levels,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
        "summary": summary(rows),
    }
    save(args.out, result)
    publish(args.doc, {"routing": result})
    print(routing_section(result))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
