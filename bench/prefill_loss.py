"""What a prefill engine killed mid-run costs: `vllm bench serve` against a P/D mesh with two
prefill workers, and the engine core of one SIGKILLed once the load is flowing.

    .venv/bin/python -m bench.prefill_loss --model DIR [--mode e/p/d] [--prompts 256]
        [--concurrency 32] [--out bench/results/prefill_loss.json]

The requests the killed engine held (the prefill worker's requests in flight, as its own
gauge says just before the kill) are the most the kill may cost: its worker answers them
UNAVAILABLE and the processor sends each to the other prefill before any token has reached
a client. The client's failed count says what it did cost. Not a test: the result goes to
`--out` (JSON, by mode) and is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from bench.lib.metrics import counter
from bench.lib.results import stamp
from bench.lib.servers import Server, start_prism
from bench.lib.vllm_client import run_client

RESULT = Path("bench/results/prefill_loss.json")


def engine_core(worker_pid: int) -> psutil.Process:
    """The vLLM engine core process a worker started (it names itself VLLM::EngineCore)."""
    for child in psutil.Process(worker_pid).children(recursive=True):
        if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
            return child
    raise RuntimeError(f"worker {worker_pid} has no engine core")


def kill_when_flowing(server: Server, finished: int, outcome: dict) -> None:
    """SIGKILLs prefill-0's engine core once it has finished `finished` requests and holds
    some, noting how many its worker held."""
    metrics = server.metrics["prefill-0"]
    core = engine_core(server.pids["prefill-0"])
    while True:
        held = counter(metrics, "prism_engine_requests_in_flight")
        if held and counter(metrics, "vllm:request_success_total") >= finished:
            break
        time.sleep(0.01)
    os.kill(core.pid, signal.SIGKILL)
    outcome["held"] = held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", default="e/p/d", choices=["e/p/d", "ep/d"])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64, help="text tokens per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--kill-after", type=int, default=32, help="requests prefill-0 finishes before its kill"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="prism-prefill-loss-"))
    server = start_prism(args.mode, args.model, logs / "prism.log", prefill_workers=2)
    outcome: dict = {}
    try:
        killer = threading.Thread(
            target=kill_when_flowing, args=(server, args.kill_after, outcome), daemon=True
        )
        killer.start()
        row = run_client(server, args, logs, 1)
    finally:
        for stop in server.stop:
            stop()
    if "held" not in outcome:
        sys.exit(f"the run ended before prefill-0 had finished {args.kill_after} requests")
    result = {
        **stamp(),
        "model": args.model,
        "mode": args.mode,
        "prompts": args.prompts,
        "concurrency": args.concurrency,
        "held_at_kill": outcome["held"],
        **{k: row[k] for k in ("completed", "failed", "errors")},
    }
    # One result per mode: a run of one mode keeps the other's.
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[args.mode] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
