"""`prism serve` and `make demo` as a user runs them: real processes, no orphans left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from support.waiting import wait_for

from prism.ops.stage_process import http_ok
from prism.runtime.ports import free_port


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    return alive


def test_demo_streams_an_answer_and_stops_the_mesh(models):
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [sys.executable, "-m", "prism.ops.demo", "--model", str(models["llava"])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "assistant: " in result.stdout
    answer = result.stdout.split("assistant: ", 1)[1]
    assert "completion tokens" in answer and len(answer.split("[")[0].strip()) > 0
    # The demo's stages name its model; other processes on the machine may run Prism too.
    leftovers = [
        p for p in psutil.process_iter(["cmdline"])
        if p.pid not in before and str(models["llava"]) in " ".join(p.info["cmdline"] or [])
    ]  # fmt: skip
    assert not leftovers


# SIGTERM to a whole E/P/D `prism serve` is test_front_doors.py's last check; here a serve
# killed outright, and a stage killed and restarted before serve is sent SIGTERM.
@pytest.mark.parametrize(
    "target,sig",
    [("serve", signal.SIGKILL), ("worker", signal.SIGKILL)],
    ids=["sigkill", "worker-sigkill-then-sigterm"],
)
def test_serve_leaves_no_orphans(models, target, sig, tmp_path):
    port, ready = free_port(), tmp_path / "status.json"
    serve = subprocess.Popen(
        [sys.executable, "-m", "prism.cli", "--log-level", "warning", "serve", "--mode", "epd",
         "--model", str(models["qwen2-vl"]), "--http-port", str(port), "--grpc-port", "0",
         "--status-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Ready as prism serve says it: every stage healthy, supervised from then on (a
        # stage that dies while the mesh starts ends it).
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert serve.poll() is None, "prism serve exited before it was ready"
            assert time.monotonic() < deadline, "prism serve did not become ready"
            time.sleep(0.5)
        descendants = psutil.Process(serve.pid).children(recursive=True)
        # worker, its vLLM engine core and the front at least.
        assert len(descendants) >= 3
        if target == "worker":
            # A stage that dies abruptly is started again; its engine process goes with it.
            worker = next(p for p in descendants if " worker " in " ".join(p.cmdline()))
            worker.send_signal(sig)
            assert not wait_gone([worker], timeout=30)

            def restarted() -> bool:
                # The launcher's, or its stage template's (prism.ops.template).
                for child in psutil.Process(serve.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):  # the killed one, a zombie
                        if " worker " in " ".join(child.cmdline()):
                            return True
                return False

            assert wait_for(restarted, timeout=30)
            assert wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), timeout=300)
            assert serve.poll() is None
            descendants += psutil.Process(serve.pid).children(recursive=True)
            sig = signal.SIGTERM
        os.kill(serve.pid, sig)
        serve.wait(timeout=60)
        alive = wait_gone(descendants, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if serve.poll() is None:
            serve.kill()


def test_json_logs_are_json_on_every_line_of_every_stage(models, tmp_path):
    """`--log-format json`: Prism's lines, vLLM's own (its engine core's too), uvicorn's and
    any stray print are each one JSON object, naming the stage that wrote it."""
    port, ready, out = free_port(), tmp_path / "status.json", tmp_path / "out.log"
    with open(out, "w") as output:
        serve = subprocess.Popen(
            [sys.executable, "-m", "prism.cli", "serve", "--log-format", "json", "--mode",
             "epd", "--model", str(models["qwen2-vl"]), "--http-port", str(port),
             "--grpc-port", "0", "--status-file", str(ready)],
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert wait_for(lambda: ready.exists() or serve.poll() is not None, timeout=300)
            assert serve.poll() is None, out.read_text()[-3000:]
            reply = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={"model": str(models["qwen2-vl"]), "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]},
                timeout=60,
            )  # fmt: skip
            assert reply.status_code == 200
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(isinstance(record, dict) for record in records)
    stages = {record["stage"] for record in records if "stage" in record}
    assert {"worker-0", "front"} <= stages
    assert any(str(record.get("logger", "")).startswith("vllm") for record in records)
    assert any(record.get("role") == "worker" for record in records)
    # The launcher's own lines too: the endpoints once ready.
    assert any(str(record.get("message", "")).startswith("prism (epd) ready") for record in records)
