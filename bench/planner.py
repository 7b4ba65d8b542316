"""The planner against fixed replica splits, on a load that steps from text chats to
image-heavy requests and back: E/PD, simulated workers (or real vLLM engines with
`--engine vllm`), encoders whose vision tower is made as slow as a larger one's
(`--sim-encode-ms`).

    .venv/bin/python -m bench.planner --model DIR [--engine sim|vllm] [--phase-s 60]
        [--budget 4] [--fixed 1+3,2+2,3+1] [--out JSON] [--doc docs/benchmarks.md]

The load is open (requests arrive at a rate, as users do, whatever the mesh's pace):
text chats with long answers (the workers' load), then requests with several images and
short answers (the encoders'), then text again. Each run is a `prism serve` of its own:
fixed splits of `--budget` replicas (encoders+workers), and the planner from one of each
within the same budget. Per run: SLO attainment (the share of requests whose time to first
token and mean time between tokens both meet their goals, failed requests counted as
missing them), per phase and overall; requests/s answered; requests failed; and the
replicas of each role over time (a figure beside the page). Not a test: results go to
`--out` (bench/results/planner.json), and `--doc` is rendered again with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.lib.load import ServerFailed, image_url, one
from bench.lib.metrics import counter
from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.sections.planner import planner_section
from bench.lib.stats import percentile
from bench.lib.text import words
from prism.runtime.ports import free_port

PHASES = ("text", "images", "text")


class Load:
    """The step load's shape: its rates and requests, and the mesh's timing that makes
    text chats the workers' load and images the encoders'."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.phases = PHASES
        self.rates = [args.rate] * len(PHASES)
        # The client waits for every answer (see PDLoad.abandon).
        self.abandon = False
        self.images = args.images
        self.text_tokens = args.text_tokens
        self.image_tokens = args.image_tokens
        self.ttft_s = args.ttft_slo_ms / 1000
        self.itl_s = args.itl_slo_ms / 1000

    def body(self, model: str, phase: str, seed: int) -> dict:
        if phase == "text":
            content: list[dict] = []
            tokens = self.text_tokens
        else:
            content = [{"type": "image_url", "image_url": {"url": image_url(seed * 16 + i)}}
                       for i in range(self.images)]  # fmt: skip
            tokens = self.image_tokens
        content.append({"type": "text", "text": words(f"{seed} question", 40)})
        return {"model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip


class Served:
    """`prism serve` in `mode` with `args`, until `stop`."""

    def __init__(
        self, model: str, engine: str, args: list[str], log: Path, mode: str = "e/pd"
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        status = log.with_suffix(".json")
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prism.cli", "--log-level", "info", "serve",
                 "--mode", mode, "--model", model, "--engine", engine, "--front-workers", "1",
                 "--http-port", str(self.port), "--status-file", str(status), *args],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 300
        while not status.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prism serve did not start; see {log}")
            time.sleep(0.5)
        self.status = json.loads(status.read_text())

    def replicas(self, fixed: dict[str, int]) -> dict[str, int]:
        """Each role's replicas running now."""
        url = self.status.get("planner_metrics")
        if not url:
            return fixed
        return {role: int(counter(url, "prism_planner_replicas", role=role, state="running"))
                for role in fixed}  # fmt: skip

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def drive(served: Served, load: Load, phase_s: float, fixed: dict[str, int]) -> dict:
    """The step load on `served` (its phases and rates, `load`'s); each request's outcome,
    and the replicas each second. A request's time between tokens is their mean: the time
    from its first token to its last over the tokens after the first (a server may send
    several tokens in one event)."""
    url = f"{served.base_url}/v1/chat/completions"
    model = served.status["model"]
    rng = random.Random(0)
    bodies = []
    for number, (phase, rate) in enumerate(zip(load.phases, load.rates, strict=True)):
        at, seed = 0.0, 0
        while at < phase_s:
            bodies.append((number, number * phase_s + at,
                           load.body(model, phase, number * 100_000 + seed)))  # fmt: skip
            at += rng.expovariate(rate)
            seed += 1
    outcomes: list[dict] = []
    replicas: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        started = time.perf_counter()

        async def send(phase: int, at: float, body: dict) -> None:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            outcome = {"phase": phase, "at": at}
            # Past this, the request can no longer meet both goals.
            hopeless = load.ttft_s + load.itl_s * (body["max_tokens"] - 1) + 1.0
            try:
                sample = await asyncio.wait_for(
                    one(session, url, body), hopeless if load.abandon else None
                )
                after = max(sample.tokens - 1, len(sample.gaps))
                itl = sum(sample.gaps) / after if after else 0.0
                outcome |= {"ttft_s": sample.ttft, "itl_s": itl, "ok": True}
            except TimeoutError as exc:
                given_up = load.abandon and time.perf_counter() - started - at >= hopeless
                outcome |= {"ok": False, "error": str(exc)[:200] or "timeout"}
                outcome |= {"abandoned": True} if given_up else {}
            except (ServerFailed, aiohttp.ClientError) as exc:
                outcome |= {"ok": False, "error": str(exc)[:200]}
            outcomes.append(outcome)

        async def watch() -> None:
            while True:
                count = await asyncio.to_thread(served.replicas, fixed)
                replicas.append({"t": time.perf_counter() - started, **count})
                await asyncio.sleep(1.0)

        watching = asyncio.create_task(watch())
        await asyncio.gather(*(send(*item) for item in bodies))
        elapsed = time.perf_counter() - started
        watching.cancel()
    return {"outcomes": outcomes, "replicas": replicas, "seconds": elapsed}


def attainment(outcomes: list[dict], load: Load) -> float:
    met = [o for o in outcomes
           if o["ok"] and o["ttft_s"] <= load.ttft_s and o["itl_s"] <= load.itl_s]  # fmt: skip
    return len(met) / max(1, len(outcomes))


def summarize(name: str, run: dict, load: Load) -> dict:
    outcomes = run["outcomes"]
    row = {
        "run": name,
        "requests": len(outcomes),
        # Failed: an error, or no answer within the client's timeout; abandoned, left by
        # the client once it could no longer meet the goals (a miss, not a failure).
        "failed": sum(not o["ok"] and not o.get("abandoned") for o in outcomes),
        "abandoned": sum(bool(o.get("abandoned")) for o in outcomes),
        "attainment": attainment(outcomes, load),
        "requests_per_s": sum(o["ok"] for o in outcomes) / run["seconds"],
        "replicas": run["replicas"],
    }
    for number, phase in enumerate(load.phases):
        within = [o for o in outcomes if o["phase"] == number]
        row[f"attainment_{number}_{phase}"] = attainment(within, load)
        # Which goal a phase missed, when it did.
        answered = [o for o in within if o["ok"]]
        for goal in ("ttft_s", "itl_s"):
            values = [o[goal] for o in answered]
            row[f"{goal}_p90_{number}_{phase}"] = percentile(values, 90) if values else None
    errors = sorted({o["error"] for o in outcomes if not o["ok"] and not o.get("abandoned")})
    if errors:
        row["errors"] = errors[:5]
    return row


def mesh_flags(args: argparse.Namespace) -> list[str]:
    """The timing every run shares, and the goals."""
    flags = ["--sim-encode-ms", str(args.encode_ms), "--ttft-slo-ms", str(args.ttft_slo_ms),
             "--itl-slo-ms", str(args.itl_slo_ms)]  # fmt: skip
    if args.engine == "sim":
        flags += ["--sim-max-num-seqs", str(args.seqs), "--sim-decode-step-ms", str(args.step_ms)]
    return flags


def runs(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, int]]]:
    """Each run's name, `prism serve` flags, and the replicas it starts with."""
    out = []
    for split in filter(None, args.fixed.split(",")):
        encoders, workers = (int(n) for n in split.split("+"))
        if encoders + workers != args.budget:
            raise SystemExit(f"--fixed {split} is not a split of --budget {args.budget}")
        out.append((f"fixed {split}", ["--encoders", str(encoders), "--workers", str(workers)],
                    {"encoder": encoders, "worker": workers}))  # fmt: skip
    planner = planner_flags(args, {"encoder": "--encoders", "worker": "--workers"})
    out.append(("planner", planner, {"encoder": 1, "worker": 1}))
    return out


def planner_flags(args: argparse.Namespace, counts: dict[str, str]) -> list[str]:
    """`prism serve` flags of the planner from one replica of each role (`counts`: each
    role's count flag), none above the budget less one."""
    most = args.budget - 1
    flags = ["--planner", "slo"]
    for role, count in counts.items():
        flags += [count, "1", "--max-replicas", f"{role}={most}"]
    return [*flags, "--replica-budget", str(args.budget),
            "--planner-interval-s", str(args.interval_s),
            "--planner-cooldown-s", str(args.cooldown_s),
            "--warm-spares", str(args.warm_spares)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="the workers' engine: simulated, or vLLM's tiny model")  # fmt: skip
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=10.0, help="requests a second")
    parser.add_argument("--images", type=int, default=4, help="images per image request")
    parser.add_argument("--text-tokens", type=int, default=16)
    parser.add_argument("--image-tokens", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=2, help="sequences a worker holds")
    parser.add_argument("--step-ms", type=float, default=25.0)
    parser.add_argument("--encode-ms", type=float, default=40.0, help="per image")
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=100.0)
    parser.add_argument("--budget", type=int, default=4)
    parser.add_argument("--fixed", default="1+3,2+2,3+1", help="ENCODERS+WORKERS, ...")
    parser.add_argument("--interval-s", type=float, default=1.0, help="the planner's interval")
    parser.add_argument("--cooldown-s", type=float, default=4.0)
    parser.add_argument("--warm-spares", type=int, default=1)
    parser.add_argument("--out", type=Path, help="default: the engine's record")
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args()
    record = "planner" if args.engine == "sim" else f"planner_{args.engine}"
    args.out = args.out or RECORDS[record]
    load = Load(args)
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-planner-"))
    rows = []
    for name, flags, fixed in runs(args):
        log = logs / f"{name.replace(' ', '-')}.log"
        served = Served(args.model, args.engine, [*mesh_flags(args), *flags], log)
        try:
            row = summarize(name, asyncio.run(drive(served, load, args.phase_s, fixed)), load)
        finally:
            served.stop()
        rows.append(row)
        phases = ", ".join(f"{row[f'attainment_{n}_{p}']:.0%}" for n, p in enumerate(PHASES))
        print(f"{name:>10}: attainment {row['attainment']:.0%} ({phases}), "
              f"{row['requests_per_s']:.2f} req/s, {row['failed']} failed", flush=True)  # fmt: skip
    fixed_rows = [r for r in rows if r["run"] != "planner"] or [{"run": "", "attainment": 0.0}]
    best_fixed = max(fixed_rows, key=lambda r: r["attainment"])
    planned = next(r for r in rows if r["run"] == "planner")
    result = {
        **stamp(),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "doc", "model")},
        "phases": list(PHASES),
        "rows": rows,
        "best_fixed": best_fixed["run"],
        "planner_vs_best_fixed": planned["attainment"] / max(best_fixed["attainment"], 1e-9),
    }
    save(args.out, result)
    publish(args.doc, {record: result})
    print(planner_section(result))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
