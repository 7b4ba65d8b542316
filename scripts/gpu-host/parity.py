"""The oracle on a GPU host, within a budget: each mode's greedy answers to image prompts
beside one offline vLLM engine's, per model, token for token, streamed through the public
gRPC API, with the first differing position and both sides' margin where they differ.

    python3 scripts/gpu-host/parity.py OUT_DIR --model qwen2-vl=/tmp/tiny-qwen2-vl \\
        --model llava=/tmp/tiny-llava --modes epd,e/pd,e/p/d,ep/d --eager --budget 300

`--eager` runs both sides without compilation or CUDA graphs (vLLM's `--enforce-eager`): on
a GPU an engine then starts in seconds of loading instead of minutes of compiling, and
greedy parity is a check of correctness, not of speed. `--kv-cache-bytes` gives each mesh
engine its KV cache in bytes, so that the engines sharing the GPU need not start in turn. A
step that the budget no longer leaves room for (as long as the slowest of its kind so far
took, or in the run of `--expect PARITY_JSON` before: the 2B preset's first step after the
tiny models') is cut, and said to be. Everything lands in OUT_DIR/parity.json as it ends;
the exit status is 1 where a mode answered otherwise than the offline engine, or failed. A
difference where the offline engine's own top two log probabilities were equal and the mesh
took the other one is a tie, reported as such and not counted as a failure.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import parity
from bench.lib.servers import start_prism
from bench.lib.shapes import slug


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", action="append", required=True, metavar="NAME=DIR")
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--budget", type=float, default=600, help="seconds for the whole run")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--expect", type=Path, help="an earlier parity.json: its step times")
    parser.add_argument("--kv-cache-bytes", type=int, default=0,
                        help="each mesh engine's KV cache in bytes (vLLM's "
                        "--kv-cache-memory-bytes): engines on one GPU start together")  # fmt: skip
    args = parser.parse_args()
    # On SIGTERM (the lease's limit), the meshes still running are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    begin = time.monotonic()
    result: dict = {"eager": args.eager, "prompts": args.prompts, "max_tokens": args.tokens,
                    "models": {}, "cut": [], "failed": []}  # fmt: skip
    # The longest step of each kind so far: what the next one is expected to take.
    longest = {"oracle": 0.0, "mesh": 0.0}
    if args.expect and args.expect.exists():
        before = json.loads(args.expect.read_text())["models"].values()
        longest["oracle"] = max((m.get("oracle_s", 0.0) for m in before), default=0.0)
        longest["mesh"] = max((row.get("seconds", 0.0) for m in before
                               for row in m["modes"].values()), default=0.0)  # fmt: skip

    def save() -> None:
        result["seconds"] = round(time.monotonic() - begin, 1)
        args.out.joinpath("parity.json").write_text(json.dumps(result, indent=1))

    def fits(kind: str, what: str) -> bool:
        left = args.budget - (time.monotonic() - begin)
        if left > longest[kind]:
            return True
        result["cut"].append(f"{what}: {left:.0f} s left, the last {kind} took {longest[kind]:.0f}")
        print(f"cut {what} ({left:.0f} s left)", flush=True)
        save()
        return False

    vllm_flags = ("--enforce-eager",) if args.eager else ()
    if args.kv_cache_bytes:
        vllm_flags += ("--kv-cache-memory-bytes", str(args.kv_cache_bytes))
    for entry in args.model:
        name, _, model = entry.partition("=")
        rows: dict = {}
        result["models"][name] = {"model": model, "modes": rows}
        if not fits("oracle", f"{name}: the offline engine and every mode"):
            continue
        started = time.monotonic()
        expected = parity.oracle(model, args.prompts, args.tokens, eager=args.eager)
        longest["oracle"] = max(longest["oracle"], time.monotonic() - started)
        result["models"][name]["oracle_s"] = round(time.monotonic() - started, 1)
        save()
        for mode in args.modes.split(","):
            if not fits("mesh", f"{name} {mode}"):
                continue
            started = time.monotonic()
            log = args.out / f"{name}-{slug(mode)}.log"
            try:
                # At INFO, the log says where each stage's start went, phase by phase.
                server = start_prism(mode, model, log, vllm_flags, log_level="info")
            except RuntimeError as exc:
                result["failed"].append(f"{name} {mode}: {exc}")
                continue
            ready = time.monotonic() - started
            try:
                got = parity.answers(server.grpc_address, model, args.prompts, args.tokens)
            finally:
                for stop in server.stop:
                    stop()
            took = time.monotonic() - started
            longest["mesh"] = max(longest["mesh"], took)
            compared = parity.compare(expected, got)
            ties = sum(row.get("tie", False) for row in compared)
            rows[mode] = {"start_s": round(ready, 1), "seconds": round(took, 1),
                          "rows": compared, "equal": all(row["equal"] for row in compared),
                          "ties": ties}  # fmt: skip
            print(f"{time.monotonic() - begin:7.1f} s  {name} {mode}: started in {ready:.0f} s, "
                  f"{sum(r['equal'] for r in compared)}/{len(compared)} prompts equal"
                  + (f", {ties} differing only at a tie" if ties else ""), flush=True)  # fmt: skip
            save()
    save()
    unequal = [f"{name} {mode}" for name, model in result["models"].items()
               for mode, row in model["modes"].items()
               if not all(r["equal"] or r.get("tie") for r in row["rows"])]  # fmt: skip
    for what in unequal + result["failed"]:
        print(f"NOT EQUAL or failed: {what}", flush=True)
    return 1 if unequal or result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
