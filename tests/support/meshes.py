"""Meshes as the tests start them (`start_mesh`: every stage a real process, forked from
the tests' one stage template), and how a streamed request to one ended."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
import httpx
import pytest

from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import ModelConfig
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.ops.stage_process import StageProcess
from prism.ops.template import ALL_MODULES, Template
from prism.rpc.channel import sync_channel
from prism.runtime.ports import free_port
from support import metrics
from support.content import data_url, image_part, png, user


def unavailable(reason: str) -> NoReturn:
    """Ends a test that cannot run on this machine: a skip, or a failure where
    PRISM_TESTS_STRICT=1 says that everything it needs is there (CI: root, Node.js, npm's
    registry), so that a test never passes there by not running."""
    if os.environ.get("PRISM_TESTS_STRICT") == "1":
        pytest.fail(f"cannot run here, and PRISM_TESTS_STRICT=1: {reason}")
    pytest.skip(reason)


# Video caps of the tests' meshes: low enough that tests can pass them with small videos.
VIDEO_CAPS = {"max_video_frames": 100, "max_video_seconds": 30, "max_video_pixels": 128 * 96}

# Meshes and loaders in tests may fetch from this name, though it is loopback.
ALLOWED_HOST = "localhost"


@dataclass
class RunningMesh:
    family: str
    mode: str
    model: str
    mesh: Mesh
    log_path: Path
    _channels: dict[str, grpc.Channel] = field(default_factory=dict)
    # How the requests sent the moment the mesh was ready ended (`stream_outcome`).
    first_outcomes: list[str] = field(default_factory=list)

    def channel(self, stage: str) -> grpc.Channel:
        """One channel per stage for the mesh's life, connected before its first call, as
        a long-lived client keeps one."""
        if stage not in self._channels:
            channel = sync_channel(self.address(stage))
            grpc.channel_ready_future(channel).result(timeout=60)
            self._channels[stage] = channel
        return self._channels[stage]

    def stop(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self.mesh.stop()

    @property
    def base_url(self) -> str:
        return next(stage.url for stage in self.mesh.stages if stage.url) + "/v1"

    @property
    def processor(self) -> str:
        """The public gRPC API: the front's, or the processor's where the gateway is apart."""
        return next(s.address for s in self.mesh.stages if s.name in ("front", "processor"))

    @property
    def worker(self) -> str:
        return self.mesh.address("worker")

    @property
    def engine_stages(self) -> list[str]:
        """Names of every worker stage, whatever its role."""
        roles = ("worker", "prefill", "decode")
        return [s.name for s in self.mesh.stages if s.name.rsplit("-", 1)[0] in roles]

    @property
    def engines(self) -> list[str]:
        """Addresses of every worker stage, whatever its role."""
        return [self.mesh.address(name) for name in self.engine_stages]

    def address(self, stage: str) -> str:
        return self.mesh.address(stage)

    def log_problems(self, limit: int = 60) -> str:
        """The mesh log's last warnings and errors, to explain a failure."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        problems = [line for line in lines if " WARNING " in line or "ERROR" in line]
        return "\n".join(problems[-limit:])

    def metrics(self, stage: str) -> dict[str, float]:
        """Current samples of a stage's /metrics: {name{labels}: value}."""
        return metrics.samples(self.mesh.stage(stage).metrics_url)

    def metric(self, stage: str, name: str, **labels: str) -> float:
        """Sum of a stage's samples called `name` whose labels include `labels`."""
        return metrics.total(self.mesh.stage(stage).metrics_url, name, **labels)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


ENGINE_MAX_NUM_SEQS = 72


# The engines' LoRA where a mesh serves adapters: the two it serves and one loaded at run
# time at once (test_lora refuses a fourth), of the rank fixtures.adapters builds.
LORA_RANK = 8
LORA_FLAGS = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", str(LORA_RANK)]


def mesh_config(mode: str, model: str, **fields: Any) -> MeshConfig:
    """A MeshConfig with `fields` set by name wherever each lives (workers=2: its serve
    config's, routing="kv": its routing config's; vllm_flags: its own), or a whole config
    in its place (registry=RegistryConfig(...))."""
    # The public gRPC API on a free port (the CLI's default, 50050, would be every mesh's).
    # One front, whatever the cores: tests read its metrics by its name.
    config = MeshConfig(ModelConfig(model), ServeConfig(mode, grpc_port=0, front_workers=1))
    parts = [part for part in vars(config).values() if dataclasses.is_dataclass(part)]
    for name, value in fields.items():
        if dataclasses.is_dataclass(value):
            setattr(config, name, value)
            continue
        owners = [part for part in parts if name in {f.name for f in dataclasses.fields(part)}]
        (owner,) = owners or [config]
        setattr(owner, name, value)
    return config


_template: Template | None = None


def stage_template() -> Template:
    """The tests' one stage template (prism.ops.template), started with the first mesh:
    every mesh's stages on the CPU are forked from it, so that none imports vLLM again."""
    global _template
    if _template is None:
        _template = Template(ALL_MODULES)
    return _template


def close_template() -> None:
    """Ends the tests' stage template, if one was started."""
    if _template is not None:
        _template.close()


def start_mesh(
    family: str,
    mode: str,
    model: Path,
    log_dir: Path,
    place: Callable[[list[StageProcess]], None] | None = None,
    **config: Any,
) -> RunningMesh:
    """Starts a mesh; `config` sets further fields (replicas, registry: `mesh_config`), and
    `place` may move the planned stages elsewhere (`hosts.place`)."""
    if config.get("engine", "vllm") == "vllm":
        # A vLLM engine argument through `prism serve` to every engine (test_metrics reads
        # it back from the running engines); above the tests' concurrency, so it limits none.
        flags = ["--max-num-seqs", str(ENGINE_MAX_NUM_SEQS)]
        if config.get("lora_modules"):
            flags += LORA_FLAGS
        config.setdefault("vllm_flags", flags)
    config = mesh_config(
        mode,
        str(model),
        http_port=free_port(),
        # The Batch API's store with the mesh's logs, not in the user's home.
        **{
            "log_level": "warning",
            "fetch_allow": [ALLOWED_HOST],
            **VIDEO_CAPS,
            "batch_store": str(log_dir / "batches"),
            **config,
        },
    )
    stages = plan(config)
    if place is not None:
        place(stages)
    mesh = Mesh(stages, stage_template())
    log_path = log_dir / f"mesh-{family}-{mode.replace('/', '')}.log"
    with open(log_path, "w") as log:
        try:
            mesh.start(timeout=300, log=log)
        except BaseException as exc:
            mesh.stop()
            if not isinstance(exc, Exception):
                raise  # Ctrl-C (KeyboardInterrupt) stops the run, not just this mesh
            tail = log_path.read_text()[-4000:]
            raise RuntimeError(f"mesh failed to start: {exc!r}\n{tail}") from None
    return RunningMesh(family, mode, str(model), mesh, log_path)


def stream_outcome(
    base_url: str, body: dict, timeout: float = 120, expected: str | None = None
) -> str:
    """How one streamed request ended: "completed" (every one of its `max_tokens`, with
    `ignore_eos`, and the text `expected` if given), "wrong text" (completed with another),
    "error CODE" (an HTTP error or an error event), "short N" (fewer tokens, no error), or
    "dropped: ..." (the connection broke)."""
    body = {**body, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens, text = None, ""
    try:
        with httpx.stream("POST", f"{base_url}/chat/completions", json=body,
                          timeout=timeout) as reply:  # fmt: skip
            if reply.status_code != 200:
                return f"error {json.loads(reply.read())['error']['code']}"
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return f"error {event['error']['code']}"
                text += "".join(c["delta"].get("content") or "" for c in event["choices"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return f"dropped: {exc!r}"
    if tokens != body["max_tokens"]:
        return f"short {tokens}"
    return "wrong text" if expected is not None and text != expected else "completed"


def first_requests(mesh: RunningMesh, count: int = 8) -> list[str]:
    """Sends `count` streamed chats at once, the moment the mesh reports ready (half with
    an image); returns how each ended."""
    outcomes: list[str] = [""] * count

    def send(i: int) -> None:
        parts = [image_part(data_url(png(100 + i)))] if i % 2 else []
        body = {"model": mesh.model, "messages": user(*parts, "Tell me more."),
                "max_tokens": 32, "temperature": 0}  # fmt: skip
        outcomes[i] = stream_outcome(mesh.base_url, body)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes
