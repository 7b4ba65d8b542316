"""An idle mesh leaves the machine alone and its health checks hold, idle and under load.

An E/P/D mesh registered with Consul (tests/support/consul_double.py, which runs the registered gRPC
and HTTP checks as the agent does) is left idle for a minute, after a few requests: no
process of any stage, engines included, keeps a core busy polling, and no check goes
critical. Then a storm of greedy streamed requests: every one is answered whole, with
offline vLLM's text, and still no check goes critical.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import httpx
import psutil
from support.cases import run_oracle
from support.consul_double import ConsulDouble
from support.content import data_url, image_part, png, user
from support.meshes import stage_template, start_mesh, stream_outcome
from support.waiting import wait_for

from prism.config.registry import RegistryConfig

# PRISM_IDLE_S=300 for the five idle minutes a deployment on Consul must stay green.
IDLE_S = float(os.environ.get("PRISM_IDLE_S", "60"))
# Of one core: the bar for every process, engines included (whose gloo threads take it
# only under the timer slack `prism.engine.extension` gives them).
LIMIT = 0.02
STAGES = ["prism-encoder", "prism-prefill", "prism-decode", "prism-processor", "prism-gateway"]


def cpu_seconds(pid: int) -> float:
    """User and system time of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def storm_case(i: int) -> tuple:
    """The storm's `i`th request, greedy: odd ones with one of four images."""
    parts = [image_part(data_url(png(i % 8)))] if i % 2 else []
    return ("chat", user(*parts, "More."), 16, {"ignore_eos": True})


def storm(mesh, count: int, concurrency: int, expected: dict[str, str]) -> Counter[str]:
    """`count` streamed requests (`storm_case`), `concurrency` at a time: how each ended,
    each answer compared with `expected` (offline vLLM's, by the case's JSON)."""
    outcomes: Counter[str] = Counter()
    pending = iter(range(count))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            case = storm_case(i)
            body = {"model": mesh.model, "messages": case[1], "max_tokens": 16,
                    "temperature": 0}  # fmt: skip
            outcome = stream_outcome(mesh.base_url, body, expected=expected[json.dumps(case)])
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    return outcomes


def test_an_idle_e_p_d_mesh_takes_no_cpu_and_keeps_its_checks_passing_idle_and_in_a_storm(
    models, tmp_path
):
    cases = {json.dumps(storm_case(i)): storm_case(i) for i in range(8)}
    answers = run_oracle(models["llava"], tmp_path, cases)
    expected = {key: answer["text"] for key, answer in answers.items()}
    assert len(set(expected.values())) == len(expected) == 5
    # Checks every second with a 2 s timeout: a minute idle sees as many as five minutes
    # at Consul's usual 5 s.
    with ConsulDouble() as consul:
        registry = RegistryConfig(consul.url, consul_check_interval="1s",
                                  consul_check_timeout="2s")  # fmt: skip
        mesh = start_mesh("llava", "e/p/d", models["llava"], tmp_path, registry=registry)
        try:
            assert wait_for(lambda: all(consul.passing(name) for name in STAGES), timeout=30), (
                consul.states(),
                consul.transitions,
            )
            settled = len(consul.transitions)
            for seed in range(3):
                messages = user(image_part(data_url(png(200 + seed))), "Hello")
                body = {"model": mesh.model, "max_tokens": 8, "messages": messages}
                reply = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)
                assert reply.status_code == 200, reply.text
            assert wait_for(lambda: not mesh.metric("front", "prism_requests_in_flight"))

            # The stages, their engine cores, and the template they were forked from.
            template = stage_template().process.pid
            processes = {template: f"template python {template}"}
            for stage in mesh.mesh.stages:
                parent = psutil.Process(stage.process.pid)
                for process in [parent, *parent.children(recursive=True)]:
                    processes[process.pid] = f"{stage.name} {process.name()} {process.pid}"
            before = {pid: cpu_seconds(pid) for pid in processes}
            time.sleep(IDLE_S)
            busy = {
                name: round((cpu_seconds(pid) - before[pid]) / IDLE_S, 4)
                for pid, name in processes.items()
            }
            print("idle share of a core:", busy)
            assert max(busy.values()) < LIMIT, busy
            assert consul.transitions[settled:] == []

            outcomes = storm(mesh, count=160, concurrency=32, expected=expected)
            assert outcomes == {"completed": 160}, (outcomes, mesh.log_problems())
            assert consul.transitions[settled:] == []
        finally:
            mesh.stop()
