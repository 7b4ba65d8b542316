"""Two fronts sharing their ports (`prism serve --front-workers 2`) on simulated workers:
the kernel spreads new connections over both, each follows every worker's cache for `kv`
routing, a conversation's follow-up finds its first turn at either, and when one is
killed the other takes every new connection."""

from __future__ import annotations

import os
import signal

import httpx
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh, stream_outcome
from support.waiting import wait_for

FRONTS = ["front-0", "front-1"]
WORKERS = ["worker-0", "worker-1"]
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def answered(mesh, front: str, endpoint: str = CHAT) -> float:
    return mesh.metric(front, "prism_requests_total", endpoint=endpoint, status="200")


def follow_ups_find_their_first_turns(mesh) -> None:
    """Conversations of two turns, each request on a connection of its own: the kernel
    hands a follow-up to either front, and every one finds its first turn."""
    url = f"{mesh.base_url}/responses"
    for n in range(8):
        body = {"model": mesh.model, "input": f"Question {n}", "max_output_tokens": 4}
        first = httpx.post(url, json=body, timeout=60).json()
        follow_up = httpx.post(url, json={**body, "previous_response_id": first["id"]},
                               timeout=60)  # fmt: skip
        assert follow_up.status_code == 200, follow_up.text
        # The first turn is in the prompt.
        used = follow_up.json()["usage"]["input_tokens"]
        assert used > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert wait_for(lambda: sum(answered(mesh, f, RESPONSES) for f in FRONTS) == 16)
    assert all(answered(mesh, front, RESPONSES) for front in FRONTS)


def test_fronts_share_the_doors_follow_every_cache_and_outlive_one_another(models, tmp_path):
    mesh = start_mesh("llava", "epd", models["llava"], tmp_path, workers=2, routing="kv",
                      engine="sim", front_workers=2)  # fmt: skip
    try:
        assert wait_for(lambda: all(
            mesh.metric(front, "prism_kv_snapshots_total", replica=mesh.address(worker))
            for front in FRONTS for worker in WORKERS
        )), mesh.log_problems()  # fmt: skip
        body = {"model": mesh.model, "max_tokens": 8,
                "messages": user(image_part(data_url(png(5))), "Describe it.")}  # fmt: skip
        # Each on a connection of its own: the kernel picks a front for each.
        outcomes = [stream_outcome(mesh.base_url, body) for _ in range(32)]
        assert outcomes == ["completed"] * 32, mesh.log_problems()
        # Counted once each handler has ended, a moment after its client's last read.
        assert wait_for(lambda: sum(answered(mesh, front) for front in FRONTS) == 32)
        assert all(answered(mesh, front) for front in FRONTS)
        follow_ups_find_their_first_turns(mesh)
        os.killpg(mesh.mesh.stage("front-1").process.pid, signal.SIGKILL)
        assert wait_for(lambda: mesh.mesh.stage("front-1").process.poll() is not None)
        before = answered(mesh, "front-0")
        outcomes = [stream_outcome(mesh.base_url, body) for _ in range(16)]
        assert outcomes == ["completed"] * 16, mesh.log_problems()
        assert wait_for(lambda: answered(mesh, "front-0") == before + 16)
    finally:
        mesh.stop()
    # The fronts' shared store of conversations goes with the mesh.
    (store,) = {stage.argv[stage.argv.index("--responses-store") + 1]
                for stage in mesh.mesh.stages if stage.name in FRONTS}  # fmt: skip
    assert not os.path.exists(os.path.dirname(store))
