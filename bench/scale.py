"""The front at scale: Prism's gateway and processor before N simulated workers, beside
NVIDIA Dynamo's frontend before `dynamo.mocker` with the same timing.

    .venv/bin/python -m bench.scale --model models/tiny-llava [--workers 16]
        [--streams 64,256,1024] [--requests 2048] [--max-tokens 32] [--rounds 1]
        [--out bench/results/scale.json] [--doc docs/benchmarks.md] [--profile DIR]

Every engine is simulated, all of a side's in one process, each its own replica to routing
(Prism: `prism worker --engine sim --sim-engines N`; Dynamo: its mocker with
`--num-workers N`), with the same step times, so that what is measured is the front: HTTP,
chat templating and tokenization, each request's image loaded and validated, routing, and
the token stream back. At each level of concurrent streams, a bounded count of streaming
chat requests (one new image each, after a warm-up of one request per stream): requests/s;
time to first token beyond the simulated prefill (TTFT minus one step with the request's
prompt), p50 and p99; inter-token latency p99; CPU seconds per 1000 requests of each
front process; requests that failed, by reason. With `--profile`, py-spy records each
Prism front process at the highest level and writes a flame graph per process there. Not
a test: results go to `--out`, and `--doc` is rendered again from the results files with
them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import psutil

from bench.lib.load import (
    Sample,
    ServerFailed,
    chat,
    failure_reason,
    image_url,
    normalised,
    one,
)
from bench.lib.profile import finish, record
from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.servers import (
    DYNAMO_PYTHON,
    await_ready,
    dynamo_env,
    served_models,
    spawn,
    stop_all,
)
from bench.lib.stats import percentile
from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import LimitConfig, LogConfig, ModelConfig
from prism.config.engine import EngineConfig
from prism.config.gateway import HttpConfig
from prism.config.sim import SimEngineConfig
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.runtime.ports import free_port


@dataclass(frozen=True)
class Timing:
    """The simulated engines' timing, one for both sides."""

    decode_step_ms: float = 5.0
    prefill_tokens_per_s: float = 20_000.0
    block_size: int = 16
    kv_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192

    def prefill_ms(self, prompt_tokens: int) -> float:
        """One step with the prompt: what its first token takes in an idle engine."""
        return self.decode_step_ms + 1000 * prompt_tokens / self.prefill_tokens_per_s

    def sim(self, engines: int) -> SimEngineConfig:
        """Prism's simulated engines: `engines` of them in one process."""
        return SimEngineConfig(
            sim_engines=engines,
            sim_prefill_tokens_per_s=self.prefill_tokens_per_s,
            sim_decode_step_ms=self.decode_step_ms,
            sim_block_size=self.block_size,
            sim_kv_blocks=self.kv_blocks,
            sim_max_num_seqs=self.max_num_seqs,
            sim_max_num_batched_tokens=self.max_num_batched_tokens,
        )

    def mocker_profile(self, path: Path, max_len: int = 16384) -> Path:
        """The same timing as dynamo.mocker's profile (its NPZ form): a prompt of `isl`
        tokens takes one step and its tokens; a decode step takes the step, whatever the
        KV it holds."""
        isl = np.arange(0, max_len + 1, 16, dtype=float)
        grid = np.linspace(0, 1_000_000, 8)
        np.savez(
            path,
            prefill_isl=isl,
            prefill_ttft_ms=np.array([self.prefill_ms(int(n)) for n in isl]),
            decode_active_kv_tokens=grid,
            decode_context_length=np.linspace(1, max_len, 8),
            decode_itl=np.full((len(grid), 8), self.decode_step_ms),
        )
        return path


@dataclass
class Front:
    name: str
    base_url: str
    model: str
    # The processes of the front, by name.
    pids: dict[str, int] = field(default_factory=dict)
    # The simulated engines' processes: on a machine of few cores they share it.
    engine_pids: list[int] = field(default_factory=list)
    stop: list[Callable[[], None]] = field(default_factory=list)


def start_prism(name: str, model: str, workers: int, timing: Timing, log: Path) -> Front:
    """Prism's front named `name`: prism, then any of -split (a gateway apart), -xN (N
    fronts on one port), -iN (--stream-interval N)."""
    serve = ServeConfig("epd", workers=workers, grpc_port=0, front_workers=1)
    engine = EngineConfig(engine="sim")
    for part in name.split("-")[1:]:
        if part == "split":
            serve.front = "split"
        elif part[0] == "x":
            serve.front_workers = int(part[1:])
        elif part[0] == "i":
            engine.stream_interval = int(part[1:])
        else:
            raise ValueError(f"unknown front {name!r}")
    port = free_port()
    config = MeshConfig(ModelConfig(model), serve, HttpConfig(http_port=port), engine=engine,
                        sim=timing.sim(workers), limit=LimitConfig(0),
                        log=LogConfig("warning"))  # fmt: skip
    mesh = Mesh.forking(plan(config))
    with open(log, "w") as out:
        mesh.start(timeout=300, log=out)
    pids = {s.name: s.process.pid for s in mesh.stages
            if s.name.startswith(("front", "gateway", "processor"))}  # fmt: skip
    engines = [s.process.pid for s in mesh.stages if s.name.startswith("worker")]
    return Front(name, f"http://127.0.0.1:{port}", model, pids, engines, [mesh.stop])


def start_dynamo(model: str, workers: int, timing: Timing, logs: Path) -> Front:
    """Dynamo's frontend and `workers` mocker engines (in one process, as its
    --num-workers runs them)."""
    if not DYNAMO_PYTHON.exists():
        raise SystemExit("Dynamo is not installed: run `make bench-anchors` first")
    env = dynamo_env(logs)
    profile = timing.mocker_profile(logs / "mocker-profile.npz")
    log = logs / "dynamo-scale.log"
    port = free_port()
    frontend = [str(DYNAMO_PYTHON), "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port), "--router-mode", "round-robin"]  # fmt: skip
    mocker = [str(DYNAMO_PYTHON), "-m", "dynamo.mocker", "--model-path", model,
              "--num-workers", str(workers), "--planner-profile-data", str(profile),
              "--block-size", str(timing.block_size),
              "--num-gpu-blocks-override", str(timing.kv_blocks),
              "--max-num-seqs", str(timing.max_num_seqs),
              "--max-num-batched-tokens", str(timing.max_num_batched_tokens),
              "--enable-prefix-caching"]  # fmt: skip
    processes = [spawn(mocker, log, env), spawn(frontend, log, env)]
    base_url = f"http://127.0.0.1:{port}"
    await_ready(lambda: bool(served_models(base_url)), processes, "Dynamo", log)
    return Front("dynamo", base_url, served_models(base_url)[0], {"frontend": processes[1].pid},
                 [processes[0].pid], [lambda: stop_all(processes)])  # fmt: skip


def cpu_seconds(front: Front) -> dict[str, float]:
    """CPU seconds so far of each front process, and of all the engines together."""
    out = {}
    for name, pid in front.pids.items():
        times = psutil.Process(pid).cpu_times()
        out[name] = times.user + times.system
    out["engines"] = 0.0
    for pid in front.engine_pids:
        times = psutil.Process(pid).cpu_times()
        out["engines"] += times.user + times.system
    return out


async def drive(front: Front, streams: int, warm_up: list[dict], load: list[dict]) -> dict:
    url = f"{front.base_url}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=900)
    ) as session:
        await asyncio.gather(*(one(session, url, body | {"model": front.model})
                               for body in warm_up))  # fmt: skip
        queue = [body | {"model": front.model} for body in load]
        samples: list[Sample] = []
        failures: Counter[str] = Counter()

        async def stream() -> None:
            while queue:
                try:
                    samples.append(await one(session, url, queue.pop()))
                except (aiohttp.ClientError, ServerFailed, TimeoutError) as exc:
                    failures[normalised(failure_reason(exc))] += 1

        before = cpu_seconds(front)
        started = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        elapsed = time.perf_counter() - started
        after = cpu_seconds(front)
    return {"samples": samples, "seconds": elapsed, "failures": failures.total(),
            "failure_reasons": dict(failures.most_common()),
            "cpu": {name: after[name] - before[name] for name in after}}  # fmt: skip


def summarize(front: Front, streams: int, run: dict, timing: Timing) -> dict:
    samples: list[Sample] = run["samples"]
    ttfts = [1000 * s.ttft for s in samples]
    added = [1000 * s.ttft - timing.prefill_ms(s.prompt_tokens) for s in samples]
    gaps = [1000 * g for s in samples for g in s.gaps]
    done = max(len(samples), 1)
    return {
        "front": front.name,
        "streams": streams,
        "requests": len(samples),
        "failures": run["failures"],
        "failure_reasons": run["failure_reasons"],
        "seconds": run["seconds"],
        "requests_per_s": len(samples) / run["seconds"],
        "output_tokens_per_s": sum(s.tokens for s in samples) / run["seconds"],
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "ttft_added_ms_p50": percentile(added, 50),
        "ttft_added_ms_p99": percentile(added, 99),
        "itl_ms_p99": percentile(gaps, 99),
        # Under load a front may send several tokens in one event.
        "events_per_request": float(np.mean([len(s.gaps) + 1 for s in samples])),
        "prompt_tokens": float(np.median([s.prompt_tokens for s in samples])),
        "cpu_s_per_1000": {name: 1000 * s / done for name, s in run["cpu"].items()},
    }


def loads(model: str, levels: list[int], requests: int, max_tokens: int, round_: int) -> dict:
    """Each level's warm-up and load, every request with an image of its own."""

    def bodies(first: int, count: int) -> list[dict]:
        return [
            chat(model, [{"type": "image_url", "image_url": {"url": image_url(seed)}},
                         {"type": "text", "text": f"Question {seed}: what is in this image?"}],
                 max_tokens)
            for seed in range(first, first + count)
        ]  # fmt: skip

    out = {}
    for index, streams in enumerate(levels):
        first = 50_000_000 + round_ * 1_000_000 + index * 100_000
        out[streams] = (bodies(first, streams), bodies(first + streams, requests))
    return out


def run_front(front: Front, levels: dict, timing: Timing, profile: Path | None) -> list[dict]:
    rows = []
    for streams, (warm_up, load) in levels.items():
        top = streams == max(levels)
        recorders = record(front.pids, profile, "scale") if top else []
        run = asyncio.run(drive(front, streams, warm_up, load))
        finish(recorders, timeout=120)
        row = summarize(front, streams, run, timing)
        rows.append(row)
        cpu = " ".join(f"{k} {v:.1f}" for k, v in row["cpu_s_per_1000"].items())
        print(f"{front.name:>7} streams={streams:<5} {row['requests_per_s']:7.1f} req/s  "
              f"TTFT+ p50 {row['ttft_added_ms_p50']:7.1f} p99 {row['ttft_added_ms_p99']:7.1f} ms  "
              f"ITL p99 {row['itl_ms_p99']:7.1f} ms  events {row['events_per_request']:4.1f}  "
              f"CPU s/1000 req: {cpu}  {failures_text(row)}", flush=True)  # fmt: skip
    return rows


def failures_text(row: dict) -> str:
    """`failures N`, and each reason with its count when there are any."""
    reasons = "; ".join(f"{reason} x{count}" for reason, count in row["failure_reasons"].items())
    return f"failures {row['failures']}" + (f" ({reasons})" if reasons else "")


def medians(rounds: list[list[dict]]) -> list[dict]:
    rows = []
    for first in rounds[0]:
        same = [r for rows in rounds for r in rows
                if (r["front"], r["streams"]) == (first["front"], first["streams"])]  # fmt: skip
        reasons: Counter[str] = Counter()
        for r in same:
            reasons.update(r["failure_reasons"])
        # A failure in any round shows: failures are totals over the rounds, not medians.
        totals = {"failures": sum(r["failures"] for r in same),
                  "failure_reasons": dict(reasons.most_common())}  # fmt: skip
        row = {}
        for key, value in first.items():
            if key in totals:
                row[key] = totals[key]
            elif isinstance(value, float):
                row[key] = float(np.median([r[key] for r in same]))
            elif isinstance(value, dict):
                row[key] = {k: float(np.median([r[key][k] for r in same])) for k in value}
            else:
                row[key] = value
        row["requests_per_s_by_round"] = [r["requests_per_s"] for r in same]
        rows.append(row)
    return rows


def comparisons(rows: list[dict]) -> dict[str, float]:
    """Each of Prism's fronts against Dynamo's at each level: req/s ratio, TTFT p99 ratio."""
    out = {}
    by = {(r["front"], r["streams"]): r for r in rows}
    for (front, streams), row in by.items():
        other = by.get(("dynamo", streams))
        if not front.startswith("prism") or other is None:
            continue
        out[f"{front}_vs_dynamo_rps_ratio_s{streams}"] = (
            row["requests_per_s"] / other["requests_per_s"]
        )
        out[f"{front}_vs_dynamo_ttft_p99_ratio_s{streams}"] = (
            row["ttft_ms_p99"] / other["ttft_ms_p99"]
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--streams", default="64,256,1024")
    parser.add_argument("--requests", type=int, default=2048, help="per level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--fronts",
        default="prism,dynamo",
        help="dynamo, and prism with any of -split (a gateway apart), -xN (N fronts on one "
        "port), -iN (--stream-interval N): prism,prism-x2,prism-x2-i2,dynamo",
    )
    parser.add_argument("--out", type=Path, default=RECORDS["scale"])
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--profile", type=Path, help="write py-spy flame graphs here")
    args = parser.parse_args()
    levels = [int(s) for s in args.streams.split(",")]
    timing = Timing()
    logs = Path(tempfile.mkdtemp(prefix="prism-scale-"))

    def start(name: str) -> Front:
        if name == "dynamo":
            return start_dynamo(args.model, args.workers, timing, logs)
        return start_prism(name, args.model, args.workers, timing, logs / f"{name}.log")

    rounds = []
    for round_ in range(args.rounds):
        rows: list[dict] = []
        level_loads = loads(args.model, levels, args.requests, args.max_tokens, round_)
        for name in args.fronts.split(","):
            front = start(name)
            try:
                profile = args.profile if round_ == args.rounds - 1 and name == "prism" else None
                rows += run_front(front, level_loads, timing, profile)
            finally:
                for stop in front.stop:
                    stop()
        rounds.append(rows)
    rows = medians(rounds)
    result = {
        **stamp(),
        "model": args.model,
        "workers": args.workers,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "timing": timing.__dict__,
        "rows": rows,
        **comparisons(rows),
    }
    save(args.out, result)
    publish(args.doc, {"scale": result})
    print(json.dumps(comparisons(rows), indent=2))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
