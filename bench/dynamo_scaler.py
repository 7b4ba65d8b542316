"""What Kubernetes is to NVIDIA Dynamo's planner, on one machine: it applies the
planner's decisions (`environment: virtual`) to `dynamo.mocker` workers. Run with
Dynamo's own Python (.anchors/dynamo), by bench/planner_dynamo.py:

    .anchors/dynamo/bin/python -m bench.dynamo_scaler --status FILE --logs DIR
        [--prefill 1] [--decode 1] -- MOCKER ARGV...

It starts the workers each role begins with, then waits for the planner's decisions
(`VirtualConnectorClient`, through etcd): for each, it starts a worker of a role that
is to grow (`--disaggregation-mode prefill|decode`, one engine a process) or stops the
newest of a role that is to shrink (SIGTERM, waited for in a thread of its own), and
acknowledges the decision once discovery counts the workers it asked for, as the
operator does once the pods are ready. Twice a second it writes the workers discovery
counts by role, the planner's readiness and every decision applied to `--status`.
SIGTERM stops every worker it started. Imports only Dynamo and the standard library.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from dynamo._core import DistributedRuntime, VirtualConnectorClient

NAMESPACE = "dynamo"
# The endpoint each role's workers serve under: the mocker's decode workers keep the
# component name of an aggregated one.
ENDPOINTS = {"prefill": "prefill.generate", "decode": "backend.generate"}
PLANNER = "Planner.generate"
# Seconds a worker has to register (start) or leave discovery (stop).
SETTLE_S = 60.0


class Workers:
    """The mocker processes of each role, newest last, and what discovery counts."""

    def __init__(self, runtime: DistributedRuntime, argv: list[str], logs: Path) -> None:
        self.runtime = runtime
        self.argv = argv
        self.logs = logs
        self.running: dict[str, list[subprocess.Popen]] = {role: [] for role in ENDPOINTS}
        self.stopping: list[subprocess.Popen] = []
        self.clients: dict = {}
        self.started = 0

    async def watch(self) -> None:
        for role, endpoint in {**ENDPOINTS, "planner": PLANNER}.items():
            path = f"{NAMESPACE}.{endpoint}"
            self.clients[role] = await self.runtime.endpoint(path).client()

    def counted(self, role: str) -> int:
        return len(self.clients[role].instance_ids())

    def start(self, role: str) -> None:
        self.started += 1
        log = open(self.logs / f"mocker-{role}-{self.started}.log", "w")  # noqa: SIM115
        argv = [*self.argv, "--disaggregation-mode", role]
        self.running[role].append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, close_fds=True)
        )
        log.close()

    def stop_newest(self, role: str) -> None:
        process = self.running[role].pop()
        process.terminate()
        self.stopping.append(process)
        threading.Thread(target=reap, args=(process,), daemon=True).start()

    async def converge(self, wanted: dict[str, int]) -> None:
        """Starts or stops workers until each role in `wanted` has its count, then waits
        until discovery counts them."""
        for role, count in wanted.items():
            while len(self.running[role]) < count:
                self.start(role)
            while len(self.running[role]) > count:
                self.stop_newest(role)
        deadline = time.monotonic() + SETTLE_S
        while any(self.counted(role) != count for role, count in wanted.items()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not settle at {wanted}")
            await asyncio.sleep(0.1)

    def stop_all(self) -> None:
        every = [p for role in self.running.values() for p in role] + self.stopping
        for process in every:
            if process.poll() is None:
                process.terminate()
        for process in every:
            reap(process)


def reap(process: subprocess.Popen, timeout: float = 30.0) -> None:
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def write_status(path: Path, workers: Workers, decisions: list[dict]) -> None:
    status = {role: workers.counted(role) for role in ENDPOINTS}
    status |= {"planner_ready": workers.counted("planner") > 0, "decisions": decisions}
    scratch = path.with_suffix(".tmp")
    scratch.write_text(json.dumps(status))
    os.replace(scratch, path)


async def apply(workers: Workers, connector: VirtualConnectorClient, decisions: list) -> None:
    """Each of the planner's decisions in turn, acknowledged once applied."""
    while True:
        await connector.wait()
        decision = await connector.get()
        wanted = {"prefill": decision.num_prefill_workers, "decode": decision.num_decode_workers}
        wanted = {role: count for role, count in wanted.items() if count >= 0}
        decisions.append({"t": time.time(), "id": decision.decision_id, **wanted})
        print(f"decision {decision.decision_id}: {wanted}", flush=True)
        await workers.converge(wanted)
        await connector.complete(decision)
        print(f"decision {decision.decision_id} applied", flush=True)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "etcd", "tcp", event_plane="zmq")
    workers = Workers(runtime, args.mocker, args.logs)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    decisions: list[dict] = []
    try:
        await workers.watch()
        await workers.converge({"prefill": args.prefill, "decode": args.decode})
        connector = VirtualConnectorClient(runtime, NAMESPACE)
        applying = asyncio.create_task(apply(workers, connector, decisions))
        while not stop.is_set() and not applying.done():
            write_status(args.status, workers, decisions)
            await asyncio.sleep(0.5)
        if applying.done():
            applying.result()
        applying.cancel()
    finally:
        workers.stop_all()
        runtime.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--status", type=Path, required=True)
    parser.add_argument("--logs", type=Path, required=True)
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    parser.add_argument("mocker", nargs=argparse.REMAINDER, help="-- then the mocker's argv")
    arguments = parser.parse_args()
    arguments.mocker = arguments.mocker[1:] if arguments.mocker[:1] == ["--"] else arguments.mocker
    asyncio.run(main(arguments))
