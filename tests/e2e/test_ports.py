"""Ports that are taken are refused, not shared: a second `prism serve` on a door of a
running one exits 2 with one line naming the port, before it starts anything, and the
first mesh keeps serving every request; a stage started by hand on a front's port is
refused the same way, even where the fronts share their ports among themselves."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from support.waiting import wait_for

from prism.rpc.channel import check_health
from prism.runtime.ports import free_port

DOORS = [
    ("gRPC API", "--grpc-port"),
    ("HTTP", "--http-port"),
    ("KServe gRPC", "--kserve-grpc-port"),
]


def serve(model: str, ports: dict[str, int], *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "prism.cli", "--log-level", "warning", "serve", "--engine", "sim",
        "--mode", "epd", "--model", model, *(str(w) for pair in ports.items() for w in pair),
        *flags,
    ]  # fmt: skip


def refusal(argv: list[str]) -> tuple[int, list[str]]:
    second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    return second.returncode, second.stderr.strip().splitlines()


@pytest.mark.parametrize("front_workers", [1, 2])
def test_a_second_mesh_on_a_running_ones_ports_is_refused(models, tmp_path, front_workers):
    model = str(models["qwen2-vl"])
    ports = {flag: free_port() for _, flag in DOORS}
    status = tmp_path / "status.json"
    workers = ("--front-workers", str(front_workers))
    first = subprocess.Popen(
        serve(model, ports, *workers, "--status-file", str(status)),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert wait_for(lambda: status.exists() or first.poll() is not None, timeout=300)
        assert first.poll() is None, "the first prism serve exited"
        for door, flag in DOORS:
            taken = {other: free_port() for _, other in DOORS} | {flag: ports[flag]}
            code, lines = refusal(serve(model, taken, *workers))
            assert code == 2, lines
            assert lines == [
                f"prism: {door} port {ports[flag]} on 127.0.0.1 is in use by another process"
            ]
        # A front started by hand on the first mesh's gRPC port is refused too, whether the
        # fronts there share it among themselves or not.
        code, lines = refusal([
            sys.executable, "-m", "prism.cli", "front", "--model", model,
            "--port", str(ports["--grpc-port"]), "--http-port", str(free_port()),
        ])  # fmt: skip
        assert code == 2 and lines[-1].startswith("prism: gRPC port"), lines
        # The first mesh still takes every request, on each door.
        http = f"http://127.0.0.1:{ports['--http-port']}"
        for _ in range(8):
            reply = httpx.post(
                f"{http}/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 3},
                timeout=60,
            )  # fmt: skip
            assert reply.status_code == 200, reply.text
        assert check_health(f"127.0.0.1:{ports['--grpc-port']}")
        assert check_health(f"127.0.0.1:{ports['--kserve-grpc-port']}")
    finally:
        first.terminate()
        first.wait(120)
