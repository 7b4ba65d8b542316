"""An idle mesh leaves the machine alone: once its requests are done, no process of any
stage, engines included, keeps a core busy polling."""

from __future__ import annotations

import os
import time

import httpx
import psutil
import pytest
from conftest import data_url, image_part, png, user, wait_for

pytestmark = pytest.mark.e2e

IDLE_S = 60
# Of one core. An idle vLLM engine on the CPU backend keeps about 1.6 % of one in torch's
# gloo loop threads (one per process group, each waking every 10 ms), which Prism does not
# control; everything of Prism's own stays far below.
LIMIT = 0.03


def cpu_seconds(pid: int) -> float:
    """User and system time of a process so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_disaggregated_mesh_takes_almost_no_cpu(mesh):
    if mesh.mode != "e/p/d" or mesh.family != "llava":
        pytest.skip("measured once, on the mode with the most stages")
    for seed in range(3):
        body = {"model": mesh.model, "max_tokens": 8,
                "messages": user(image_part(data_url(png(200 + seed))), "Hello")}  # fmt: skip
        reply = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
    assert wait_for(lambda: not mesh.metric("processor", "prism_requests_in_flight"))
    processes = {}
    for stage in mesh.mesh.stages:
        parent = psutil.Process(stage.process.pid)
        for process in [parent, *parent.children(recursive=True)]:
            processes[process.pid] = f"{stage.name} {process.name()}"
    before = {pid: cpu_seconds(pid) for pid in processes}
    time.sleep(IDLE_S)
    busy = {
        name: round((cpu_seconds(pid) - before[pid]) / IDLE_S, 4) for pid, name in processes.items()
    }
    assert max(busy.values()) < LIMIT, busy
