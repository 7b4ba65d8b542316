"""How long a mesh takes to start, stage by stage and phase by phase: eagerly, then with
vLLM's compilation from an empty cache (cold) and again from the cache the cold start
filled (warm), all engines sharing one `--compile-cache`.

    python -m bench.start --model models/tiny-qwen2-vl --mode e/p/d

Writes bench/results/start.json: for each start, each stage's phases as `prism serve`
reports them (seconds since the mesh began to start) and when it served. Not a test.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import LimitConfig, LogConfig, ModelConfig
from prism.config.gateway import HttpConfig
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.runtime.ports import free_port

# The starts, in order: (name, vLLM flags, whether the cache is emptied first).
STARTS = (
    ("eager", [], True),
    ("compiled, cold", ["--no-enforce-eager"], True),
    ("compiled, warm", ["--no-enforce-eager"], False),
)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_once(args: argparse.Namespace, flags: list[str], cache: Path, log: Path) -> dict:
    serve = ServeConfig(args.mode, grpc_port=free_port(), compile_cache=str(cache))
    config = MeshConfig(ModelConfig(args.model), serve, HttpConfig(http_port=free_port()),
                        limit=LimitConfig(0), log=LogConfig("warning"),
                        vllm_flags=flags)  # fmt: skip
    mesh, begin, cpu = Mesh.forking(plan(config)), time.monotonic(), children_cpu_s()
    phases: dict[str, list[tuple[str, float]]] = {stage.name: [] for stage in mesh.stages}

    def report(line: str) -> None:
        name, _, rest = line.partition(": ")
        # Not the template's line (it imports before any stage starts): stages' phases.
        if name in phases:
            phases[name].append((rest.rsplit(" (", 1)[0], round(time.monotonic() - begin, 1)))

    with log.open("w") as out:
        try:
            mesh.start(args.timeout, log=out, report=report)
            ready = round(time.monotonic() - begin, 1)
        finally:
            mesh.stop()
    return {
        "ready_s": ready,
        # The stages' CPU time (their processes have ended): what the start cost.
        "cpu_s": round(children_cpu_s() - cpu, 1),
        "stages": {
            name: {"phases": seen, "serving_s": seen[-1][1]} for name, seen in phases.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="e/p/d")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default="bench/results/start.json")
    args = parser.parse_args()
    result: dict = {"model": args.model, "mode": args.mode, "when": time.strftime("%Y-%m-%d"),
                    "starts": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="prism-start-") as tmp:
        for name, flags, empty in STARTS:
            cache = Path(tmp) / ("cache-eager" if not flags else "cache")
            if empty and cache.exists():
                raise SystemExit(f"{cache} is not empty")
            started = start_once(args, flags, cache, Path(tmp) / f"{len(result['starts'])}.log")
            result["starts"][name] = started
            print(f"{name:>15}: ready in {started['ready_s']:6.1f} s, stages' CPU "
                  f"{started['cpu_s']:6.1f} s", flush=True)  # fmt: skip
            for stage, seen in started["stages"].items():
                steps = seen["phases"][1:]
                print(f"{'':17}{stage:<10} " + ", ".join(f"{p} {t:.0f}" for p, t in steps))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
