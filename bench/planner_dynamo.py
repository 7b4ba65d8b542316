"""Prism's planner beside NVIDIA Dynamo's, on one prefill/decode step load: the same
replica budget, engines of the same timing.

    .venv/bin/python -m bench.planner_dynamo --model DIR [--phase-s 50] [--budget 4]
        [--fixed 3+1,2+2,1+3] [--dynamo-fixed P+D,...] [--planners prism,dynamo]
        [--out JSON] [--doc docs/benchmarks.md]

Dynamo 1.6.1 (.anchors/dynamo and etcd: scripts/bench_anchors_planner.sh):
`dynamo.frontend` before `dynamo.mocker` prefill and decode workers, its planner (`python
-m dynamo.planner`, load mode, `environment: virtual`) deciding how many of each, and
bench/dynamo_scaler.py applying its decisions as its Kubernetes operator would; discovery
in an etcd of the run's own. Prism: `prism serve --mode ep/d --engine sim --planner slo`
(text alone, EP/D is prefill/decode), its simulated engines timed as the mocker is
(bench.scale.Timing).
Fixed splits (PREFILL+DECODE, Prism's) show whether one split serves every phase.

The load is open (Poisson arrivals) in three phases: long prompts with short answers
(prefill's load), short prompts with long answers (decode's: their KV fills the decode
engines), long prompts again. Per run: SLO attainment (the share of requests whose time
to first token and mean time between tokens both meet their goals, failed requests
counted as missing them), per phase and overall; requests/s answered; requests failed,
and those the client left once they could no longer meet both goals; each role's
replicas every second, and each planner's decisions. Not a test: results go to `--out`
(bench/results/planner-dynamo.json), and `--doc` is rendered again with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import tempfile
import time
from functools import partial
from pathlib import Path

from bench.lib.report import publish
from bench.lib.results import RECORDS, save, stamp
from bench.lib.sections.planner_dynamo import planner_dynamo_section
from bench.lib.servers import (
    DYNAMO_PYTHON,
    await_ready,
    dynamo_env,
    served_models,
    spawn,
    start_etcd,
    stop_all,
)
from bench.lib.text import words
from bench.planner import Served, drive, planner_flags, summarize
from bench.scale import Timing
from prism.runtime.ports import free_port

PHASES = ("prompts", "answers", "prompts")
# Dynamo's planner imports the AISimulate SDK, whose PyPI package only fetches its wheel
# from NVIDIA's own index; in load mode nothing of it is called, so a stand-in will do.
AISIMULATE_STANDIN = """class ForwardPassPerfModelConfig:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("AISimulate is not installed (a stand-in for the bench)")


RustForwardPassPerfModel = ForwardPassPerfModelConfig
"""


class PDLoad:
    """The step load's shape: long prompts answered briefly, then short prompts answered
    at length, then long prompts again; a rate for each kind."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.phases = PHASES
        self.rates = [args.prompt_rate, args.answer_rate, args.prompt_rate]
        self.shapes = {"prompts": (args.long_words, args.short_tokens),
                       "answers": (args.short_words, args.long_tokens)}  # fmt: skip
        self.ttft_s = args.ttft_slo_ms / 1000
        self.itl_s = args.itl_slo_ms / 1000
        # The client leaves a request once it can no longer meet both goals, as a user
        # would: a backlog's requests are misses, not a tail that outlasts the load.
        self.abandon = True

    def body(self, model: str, phase: str, seed: int) -> dict:
        length, tokens = self.shapes[phase]
        return {"model": model, "messages": [{"role": "user", "content": words(str(seed), length)}],
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip


def timing(args: argparse.Namespace) -> Timing:
    return Timing(decode_step_ms=float(args.step_ms), prefill_tokens_per_s=float(args.prefill_tps),
                  block_size=args.block_size, kv_blocks=args.kv_blocks, max_num_seqs=args.seqs,
                  max_num_batched_tokens=args.batched_tokens)  # fmt: skip


def splits(text: str, budget: int) -> list[dict[str, int]]:
    """`PREFILL+DECODE,...` as each split's replicas by role."""
    out = []
    for split in filter(None, text.split(",")):
        prefill, decode = (int(n) for n in split.split("+"))
        if prefill + decode != budget:
            raise SystemExit(f"{split} is not a split of --budget {budget}")
        out.append({"prefill": prefill, "decode": decode})
    return out


def prism_runs(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, int]]]:
    """Each of Prism's runs: its name, `prism serve` flags, the replicas it starts with."""
    shared = [*timing(args).sim(1).to_argv(), "--ttft-slo-ms", str(args.ttft_slo_ms),
              "--itl-slo-ms", str(args.itl_slo_ms)]  # fmt: skip
    out = []
    for split in splits(args.fixed, args.budget):
        flags = ["--prefill", str(split["prefill"]), "--decode", str(split["decode"])]
        out.append((f"prism fixed {split['prefill']}+{split['decode']}", [*shared, *flags], split))
    if "prism" not in args.planners.split(","):
        return out
    planner = planner_flags(args, {"prefill": "--prefill", "decode": "--decode"})
    out.append(("prism planner", [*shared, *planner], {"prefill": 1, "decode": 1}))
    return out


def planner_config(args: argparse.Namespace, model: str) -> dict:
    """Dynamo's planner in load mode: a role grows by one when any of its engines is over
    its threshold (prefill: prompt tokens queued; decode: the share of its KV cache its
    sequences, running and queued, take), shrinks by one when all are under the lower
    one, every interval; prefill and decode replicas within the budget."""
    return {"environment": "virtual", "backend": "mocker", "mode": "disagg",
            "model_name": model, "optimization_target": "load",
            "pre_deployment_sweeping_mode": "none",
            "prefill_scale_up_queue_tokens": args.dynamo_prefill_up,
            "prefill_scale_down_queue_tokens": args.dynamo_prefill_down,
            "decode_scale_up_kv_rate": args.dynamo_decode_up,
            "decode_scale_down_kv_rate": args.dynamo_decode_down,
            "load_adjustment_interval_seconds": args.dynamo_interval_s, "min_endpoint": 1,
            "max_gpu_budget": args.budget, "prefill_engine_num_gpu": 1,
            "decode_engine_num_gpu": 1, "control_api_port": 0,
            "metric_reporting_prometheus_port": 0, "live_dashboard_port": 0}  # fmt: skip


class DynamoPlanned:
    """Dynamo's frontend and the scaler of its mocker workers (`split` to begin with),
    with its planner (or, not `planned`, a fixed split), in front of an etcd of their own;
    until `stop`. As planner.Served to `drive`: `base_url`, `status["model"]`,
    `replicas`."""

    def __init__(
        self, model: str, timing: Timing, args: argparse.Namespace, logs: Path,
        split: dict[str, int], planned: bool = True,
    ) -> None:  # fmt: skip
        if not DYNAMO_PYTHON.exists():
            raise SystemExit("Dynamo is not installed: run scripts/bench_anchors_planner.sh")
        self.processes: list[subprocess.Popen] = []
        etcd, url = start_etcd(logs)
        self.processes.append(etcd)
        env = dynamo_env(logs, etcd=url) | {"SCALING_CHECK_INTERVAL": "1", "DYN_LOG": "info"}
        python, log = str(DYNAMO_PYTHON), logs / "dynamo.log"
        port = free_port()
        # Migration: a request on a worker the planner stops goes on at another.
        frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                    "--http-port", str(port), "--router-mode", "round-robin",
                    "--migration-limit", str(args.dynamo_migration)]  # fmt: skip
        self.processes.append(spawn(frontend, log, env))
        self.status_file = logs / "dynamo-scaler.json"
        scaler = [python, "-m", "bench.dynamo_scaler", "--status", str(self.status_file),
                  "--logs", str(logs), "--prefill", str(split["prefill"]),
                  "--decode", str(split["decode"]), "--",
                  *mocker_argv(model, timing, logs)]  # fmt: skip
        self.processes.append(spawn(scaler, logs / "dynamo-scaler.log", env))
        self.base_url = f"http://127.0.0.1:{port}"
        await_ready(lambda: bool(served_models(self.base_url)), self.processes, "Dynamo", log)
        self.status = {"model": served_models(self.base_url)[0]}
        self.decisions: list[dict] = []
        if planned:
            self.plan(args, env, logs)

    def plan(self, args: argparse.Namespace, env: dict[str, str], logs: Path) -> None:
        """Starts Dynamo's planner, and waits until it serves."""
        python = str(DYNAMO_PYTHON)
        standin = Path(tempfile.mkdtemp(prefix="aisimulate-", dir=logs))
        (standin / "aisimulate_core" / "sdk").mkdir(parents=True)
        (standin / "aisimulate_core" / "__init__.py").write_text("")
        (standin / "aisimulate_core" / "sdk" / "__init__.py").write_text(AISIMULATE_STANDIN)
        config = json.dumps(planner_config(args, self.status["model"]))
        planner = [python, "-m", "dynamo.planner", "--config", config]
        self.processes.append(spawn(planner, logs / "dynamo-planner.log",
                                    env | {"PYTHONPATH": str(standin)}))  # fmt: skip
        await_ready(lambda: self.scaler().get("planner_ready", False), self.processes,
                    "Dynamo's planner", logs / "dynamo-planner.log")  # fmt: skip

    def scaler(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}

    def replicas(self, fixed: dict[str, int]) -> dict[str, int]:
        """Each role's workers discovery counts now."""
        status = self.scaler()
        return {role: int(status.get(role, 0)) for role in fixed}

    def stop(self) -> None:
        self.decisions = self.scaler().get("decisions", [])
        stop_all(self.processes)


def mocker_argv(model: str, timing: Timing, logs: Path) -> list[str]:
    """One mocker engine a process, timed as Prism's simulated ones (its profile), with no
    delay for KV moved from prefill to decode (Prism's moves at a million tokens a
    second)."""
    profile = timing.mocker_profile(logs / "mocker-profile.npz")
    return [str(DYNAMO_PYTHON), "-m", "dynamo.mocker", "--model-path", model,
            "--num-workers", "1", "--planner-profile-data", str(profile),
            "--block-size", str(timing.block_size),
            "--num-gpu-blocks-override", str(timing.kv_blocks),
            "--max-num-seqs", str(timing.max_num_seqs),
            "--max-num-batched-tokens", str(timing.max_num_batched_tokens),
            "--enable-prefix-caching", "--kv-transfer-bandwidth", "0"]  # fmt: skip


# A decision in the log of `prism serve --planner slo`: its time, the role, its new count
# and why (prism.planner.loop).
DECISION = re.compile(r"^(\S+ \S+),(\d+) .*planner: (\w+) (\d+) → (\d+) \((\w+);", re.MULTILINE)


def prism_decisions(log: str, begun: float) -> list[dict]:
    """Prism's planner's decisions, each `{"t", ROLE: count, "why"}`, `t` in seconds from
    `begun` (the load's start, by the clock)."""
    out = []
    for when, millis, role, _, count, why in DECISION.findall(log):
        at = time.mktime(time.strptime(when, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
        out.append({"t": at - begun, role: int(count), "why": why})
    return out


def folder(logs: Path, name: str) -> Path:
    """A run's own directory of logs."""
    path = logs / name.replace(" ", "-")
    path.mkdir()
    return path


def run(name: str, start, load: PDLoad, args: argparse.Namespace, fixed: dict) -> dict:
    """One run: the server `start()` returns, driven through the step load, then stopped."""
    served = start()
    begun = time.time()
    try:
        row = summarize(name, asyncio.run(drive(served, load, args.phase_s, fixed)), load)
    finally:
        served.stop()
    if isinstance(served, DynamoPlanned):
        row["decisions"] = [d | {"t": d["t"] - begun} for d in served.decisions]
    else:
        row["decisions"] = prism_decisions(served.log.read_text(), begun)
    phases = ", ".join(f"{row[f'attainment_{n}_{p}']:.0%}" for n, p in enumerate(PHASES))
    print(f"{name:>16}: attainment {row['attainment']:.0%} ({phases}), "
          f"{row['requests_per_s']:.2f} req/s, {row['failed']} failed", flush=True)  # fmt: skip
    return row


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True)
    add("--phase-s", type=float, default=50.0)
    add("--prompt-rate", type=float, default=2.5, help="requests a second, long prompts")
    add("--answer-rate", type=float, default=2.5, help="requests a second, long answers")
    add("--long-words", type=int, default=1080, help="about 1.4 tokens a word")
    add("--short-words", type=int, default=70)
    add("--short-tokens", type=int, default=16, help="answers to long prompts")
    add("--long-tokens", type=int, default=600, help="answers to short prompts")
    add("--prefill-tps", type=float, default=1500.0, help="prompt tokens a second")
    add("--step-ms", type=float, default=20.0, help="an engine step, besides its prompts")
    add("--block-size", type=int, default=16)
    add("--kv-blocks", type=int, default=352, help="each engine's KV cache, in blocks")
    add("--seqs", type=int, default=256, help="sequences an engine's step holds")
    add("--batched-tokens", type=int, default=2048, help="tokens a step computes")
    add("--ttft-slo-ms", type=float, default=3000.0)
    add("--itl-slo-ms", type=float, default=30.0)
    add("--budget", type=int, default=4)
    add("--fixed", default="3+1,2+2,1+3", help="Prism's fixed splits, PREFILL+DECODE, ...")
    add("--interval-s", type=float, default=1.0, help="Prism's planner's interval")
    add("--cooldown-s", type=float, default=4.0, help="Prism's planner's cool-down")
    add("--warm-spares", type=int, default=0, help="Prism's: none, for the same budget")
    add("--dynamo-interval-s", type=int, default=5, help="Dynamo's planner's interval")
    add("--dynamo-prefill-up", type=int, default=1500, help="queued prompt tokens")
    add("--dynamo-prefill-down", type=int, default=100, help="queued prompt tokens")
    add("--dynamo-decode-up", type=float, default=60.0, help="KV cache used, %%")
    add("--dynamo-decode-down", type=float, default=20.0, help="KV cache used, %%")
    add("--dynamo-migration", type=int, default=3, help="its frontend's --migration-limit")
    add("--dynamo-fixed", default="", help="Dynamo's fixed splits, PREFILL+DECODE, ...")
    add("--planners", default="prism,dynamo", help="the planners that run: prism, dynamo")
    add("--out", type=Path, default=RECORDS["planner_dynamo"])
    add("--doc", type=Path, default=Path("docs/benchmarks.md"))
    return parser.parse_args()


def main() -> None:
    args = arguments()
    load, engines = PDLoad(args), timing(args)
    logs = Path(tempfile.mkdtemp(prefix="prism-bench-planner-dynamo-"))
    runs = []
    for name, flags, fixed in prism_runs(args):
        log = logs / f"{name.replace(' ', '-')}.log"
        runs.append((name, partial(Served, args.model, "sim", flags, log, "ep/d"), fixed))
    dynamo = partial(DynamoPlanned, args.model, engines, args)
    for split in splits(args.dynamo_fixed, args.budget):
        name = f"dynamo fixed {split['prefill']}+{split['decode']}"
        runs.append((name, partial(dynamo, folder(logs, name), split, planned=False), split))
    if "dynamo" in args.planners.split(","):
        one_each = {"prefill": 1, "decode": 1}
        start = partial(dynamo, folder(logs, "dynamo planner"), one_each)
        runs.append(("dynamo planner", start, one_each))
    rows = [run(name, start, load, args, fixed) for name, start, fixed in runs]
    result = {
        **stamp(),
        "model": args.model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "doc", "model")},
        "timing": engines.__dict__,
        "phases": list(PHASES),
        "rows": rows,
    }
    save(args.out, result)
    publish(args.doc, {"planner_dynamo": result})
    print(planner_dynamo_section(result))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
