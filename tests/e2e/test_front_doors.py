"""`prism serve`'s public doors as clients of other stacks use them: the endpoints it
prints, a Node.js client of `prism.v1` built only from protos/, and Triton's own Python
client (`tritonclient[grpc]`) on the KServe v2 port; and, once it is sent SIGTERM, no process
of its left behind. In E/P/D, the mode with the most stages to wait for and to stop (the doors
themselves are the gateway's, the same in every mode)."""

from __future__ import annotations

import base64
import importlib.util
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support.content import data_url, image_part, png, user
from support.meshes import unavailable
from transformers import AutoTokenizer

from prism.runtime.ports import free_port

HERE = Path(__file__).parent
NODE = HERE / "node"
IMAGE = png(3)
# Greedy and short, as both sides of each comparison ask.
SAMPLING = {"temperature": 0, "max_tokens": 12}


@dataclass
class Served:
    """A running `prism serve`: what it printed once ready, and its status file."""

    mode: str
    model: str
    printed: list[str]
    status: dict
    # What it said on stderr while it started.
    said: Path
    # The stages' own lines it printed before it was ready.
    stage_lines: list[str]
    # How a chat sent the moment /v1/models first listed the model ended.
    first_listed_chat: int

    def line(self, label: str) -> str:
        return next(line for line in self.printed if line.strip().startswith(label))

    def rest_chat(self, prompt: str = "What is this?") -> str:
        body = {"model": self.model, "messages": user(image_part(data_url(IMAGE)), prompt),
                **SAMPLING}  # fmt: skip
        reply = httpx.post(f"{self.status['openai']}/chat/completions", json=body, timeout=120)
        reply.raise_for_status()
        return reply.json()["choices"][0]["message"]["content"]


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line.rstrip("\n"))
    into.put(None)


def _first_listed_chat(base_url: str, model: str, serve: subprocess.Popen) -> int:
    """Polls /v1/models from the start; the status of a chat sent the moment the model is
    listed (a client waiting for the model must not be sent in early)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and serve.poll() is None:
        try:
            listed = httpx.get(f"{base_url}/models", timeout=2).json()["data"]
        except httpx.HTTPError:
            listed = []
        if listed:
            body = {"model": model, "messages": user(image_part(data_url(IMAGE)), "Hi"),
                    **SAMPLING}  # fmt: skip
            return httpx.post(f"{base_url}/chat/completions", json=body, timeout=120).status_code
        time.sleep(0.2)
    raise AssertionError("the model was never listed")


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    mode, model = "e/p/d", str(models["llava"])
    tmp = tmp_path_factory.mktemp("front-doors")
    status_file, http_port = tmp / "status.json", free_port()
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 (closed once serve is gone)
    serve = subprocess.Popen(
        [sys.executable, "-m", "prism.cli", "--log-level", "warning", "serve", "--mode", mode,
         "--model", model, "--http-port", str(http_port), "--grpc-port", "0",
         "--kserve-grpc-port", str(free_port()), "--status-file", str(status_file)],
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    printed: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(serve.stdout, printed), daemon=True).start()
    stages: list[str] = []
    descendants: list[psutil.Process] = []
    try:
        first = _first_listed_chat(f"http://127.0.0.1:{http_port}/v1", model, serve)
        # The stages log to the same output; the endpoints block is printed at once.
        lines: list[str] = []
        while not lines or not lines[-1].strip().startswith("front"):
            line = printed.get(timeout=300)
            assert line is not None, (tmp / "serve.log").read_text()[-3000:]
            if line.startswith(f"prism ({mode}) ready: ") or (lines and line.startswith("  ")):
                lines.append(line)
            else:
                stages.append(line)
        descendants = psutil.Process(serve.pid).children(recursive=True)
        yield Served(mode, model, lines, json.loads(status_file.read_text()), tmp / "serve.log",
                     stages, first)  # fmt: skip
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=60)
        finally:
            if serve.poll() is None:
                serve.kill()
            log.close()
    assert not status_file.exists(), "the status file outlived prism serve"
    # Every stage and every vLLM engine core ended with it (`test_serve.py` kills its other ways).
    _, alive = psutil.wait_procs(descendants, timeout=60)
    assert not alive, [p.cmdline() for p in alive]


def test_serve_says_each_stages_phase_while_it_starts_and_names_each_stages_lines(served):
    said = served.said.read_text().splitlines()
    for stage in ("encoder-0", "prefill-0", "decode-0", "front"):
        assert f"prism: {stage}: importing (0 s)" in said, said
        assert any(line.startswith(f"prism: {stage}: serving (") for line in said), said
    # The engines' phases, from vLLM's own lines (which --log-level warning keeps back).
    for engine in ("prefill-0", "decode-0"):
        assert any(line.startswith(f"prism: {engine}: loading weights (") for line in said)
    assert not any(re.search(r"\bINFO \d\d-\d\d \d\d:", line) for line in served.stage_lines)
    assert served.stage_lines and all(
        line.split(" | ", 1)[0].strip() in ("encoder-0", "prefill-0", "decode-0", "front")
        for line in served.stage_lines
    ), served.stage_lines[:5]


def test_serve_prints_every_endpoint_and_lists_the_model_only_once_it_can_serve(served):
    status = served.status
    assert served.first_listed_chat == 200
    assert served.printed[0] == f"prism ({served.mode}) ready: {status['openai']}"
    assert status["grpc"] in served.line("gRPC") and "prism.v1.InferenceService" in served.line(
        "gRPC"
    )
    assert status["kserve_grpc"] in served.line("KServe v2")
    roles = {stage["role"] for stage in status["stages"]}
    # The processor serves the OpenAI API and KServe too, from one process (`--front`).
    assert roles == {"encoder", "prefill", "decode", "front"}
    for stage in status["stages"]:
        assert any(stage["address"] in line and stage["metrics"] in line
                   for line in served.printed), stage  # fmt: skip
        assert httpx.get(stage["metrics"], timeout=5).status_code == 200
    models = httpx.get(f"{status['openai']}/models", timeout=5).json()["data"]
    assert [m["id"] for m in models] == [served.model]
    # Health and reflection on both public gRPC ports, in step with /health.
    doors = {status["grpc"]: "prism.v1.InferenceService",
             status["kserve_grpc"]: "inference.GRPCInferenceService"}  # fmt: skip
    for address, service in doors.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, address
            listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
            names = {s.name for reply in listing for s in reply.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The Node.js client with its two npm packages, installed on first use."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        unavailable("Node.js (node and npm) is not installed")
    if not (NODE / "node_modules" / "@grpc" / "grpc-js").exists():
        result = subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
            cwd=NODE, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if result.returncode != 0:
            reason = result.stderr.strip()[-500:]
            unavailable("npm could not install @grpc/grpc-js and @grpc/proto-loader "
                        f"(is its registry reachable?): {reason}")  # fmt: skip
    return NODE / "client.mjs"


def test_a_node_client_built_from_the_protos_streams_cancels_aborts_and_responds(
    served, node_client, tmp_path
):
    image = tmp_path / "image.png"
    image.write_bytes(IMAGE)
    result = subprocess.run(
        ["node", str(node_client), served.status["grpc"], served.model, str(image)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["models"] == [served.model]
    chat = out["chat"]
    assert chat["error"] is None and chat["finish_reason"] == "FINISH_REASON_LENGTH"
    assert chat["messages"] > 1 and chat["usage"]["completion_tokens"] == 12
    # The image crossed intact: the answer is REST's to the same chat.
    assert chat["text"] == served.rest_chat()
    assert out["cancelled"]["error"]["code"] == "CANCELLED"
    assert out["abort_found"] is True
    assert out["aborted"]["finish_reason"] == "FINISH_REASON_ABORT"
    assert out["aborted"]["error"] is None
    assert out["unknown_model"]["error"]["code"] == "NOT_FOUND"
    assert "no-such-model" in out["unknown_model"]["error"]["details"]
    assert out["broken_image"]["error"]["code"] == "INVALID_ARGUMENT"
    assert "not an image" in out["broken_image"]["error"]["details"]
    # The Responses API over gRPC: REST chat's answer to the same question, and stored.
    streamed = out["responses"]
    assert streamed["error"] is None, streamed
    assert streamed["types"][0] == "response.created"
    assert streamed["types"][-1] == "response.completed"
    final = streamed["last"]["response"]
    assert final["output"][0]["content"][0]["text"] == served.rest_chat()
    assert out["stored"] == final


def test_tritonclient_unmodified_talks_to_the_kserve_port(served, tmp_path):
    # tritonclient is imported by its own process only (see triton_client.py).
    assert importlib.util.find_spec("tritonclient") is not None, (
        "tritonclient is missing: `make setup` installs it"
    )
    tokenizer = AutoTokenizer.from_pretrained(served.model)
    parts = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    conversation = [{"role": "user", "content": parts}]
    # The backend's prompt is raw: the client applies the chat template itself.
    image_prompt = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    prompt = "Once upon a time"
    plan = {
        "url": served.status["kserve_grpc"], "model": served.model, "prompt": prompt,
        # As Triton's samples send them: strings.
        "sampling": {"temperature": "0", "max_tokens": "12"},
        "image_prompt": image_prompt, "image": base64.b64encode(IMAGE).decode(),
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = subprocess.run(
        [sys.executable, str(HERE / "triton_client.py"), str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["live"] and out["ready"] and out["model_ready"]
    inputs = {t["name"]: t["datatype"] for t in out["metadata"]["inputs"]}
    assert inputs["text_input"] == "BYTES" and inputs["image"] == "BYTES"
    assert out["config"]["config"]["model_transaction_policy"]["decoupled"] is True

    completion = httpx.post(
        f"{served.status['openai']}/completions",
        json={"model": served.model, "prompt": prompt, **SAMPLING}, timeout=120,
    ).json()["choices"][0]["text"]  # fmt: skip
    # Not streamed, the answer starts with the prompt, as Triton's vLLM backend has it.
    assert out["infer"]["text"] == prompt + completion
    assert out["infer"]["finish_reason"] == "length"
    assert out["infer"]["num_output_tokens"] == 12
    assert out["infer"]["num_input_tokens"] == len(tokenizer(prompt).input_ids)
    streamed_text, streamed_image, failed = out["stream"]
    assert streamed_text == completion
    # A raw prompt laid out by the chat template, with its image: the chat's answer.
    assert streamed_image == out["infer_image"] == served.rest_chat()
    assert "'temperature': Expected `float" in failed["error"][0]

    errors = out["errors"]
    assert errors["name"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "unexpected inference input 'prompt'" in errors["name"]["message"]
    assert errors["type"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "input 'stream' must be BOOL, got INT32" in errors["type"]["message"]
    assert errors["model"]["status"] == "StatusCode.NOT_FOUND"
