"""Shared fixtures: tiny models, the offline-vLLM oracle, images and running meshes.

Three lanes: tests/unit (pure logic and in-process servers: no engine, no subprocess, no
torch or vLLM; `make test-unit`, tests/support/unit_lane.py), tests/contract (each RPC and wire
contract against real server processes, and the code that needs torch or vLLM in-process)
and tests/e2e (meshes of real processes). Engines are expensive (about 20 s each on 2 cores),
so everything that starts one is session-scoped and shared: one shared mesh runs at a
time. Tests that start meshes of their own may run beside it, since an idle mesh takes no
CPU (`e2e/test_idle.py`).
"""

from __future__ import annotations

import prism  # noqa: F401

# Before grpc: importing prism turns gRPC's fork handlers off, and only takes effect if
# grpc is not yet loaded (prism/__init__.py).
from prism.rpc.channel import sync_channel
from prism.rpc.server import Server, start_server

# isort: split
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import grpc
import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from support import metrics, parity
from support.content import data_url, image_part, png, user, video, video_part

from prism.config.common import ModelConfig
from prism.config.stages import MeshConfig, ServeConfig
from prism.modes import MODES
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.ops.stage_process import StageProcess
from prism.ops.template import MODULES, Template
from prism.runtime.ports import free_port

# The unit lane's rules: no process, no torch, no vLLM.
pytest_plugins = ["support.unit_lane"]

FAMILIES = ("llava", "qwen2-vl")
ROOT = Path(__file__).parent


@contextlib.contextmanager
def serving(register: Callable[[Any], None], services: list[str]) -> Iterator[str]:
    """A gRPC server (`start_server`, serving) on an event loop thread of its own, for
    sync tests; yields its address."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> Server:
        server = await start_server("127.0.0.1:0", register, services)
        await server.set_serving(services)
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        asyncio.run_coroutine_threadsafe(server.server.stop(None), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def unavailable(reason: str) -> NoReturn:
    """Ends a test that cannot run on this machine: a skip, or a failure where
    PRISM_TESTS_STRICT=1 says that everything it needs is there (CI: root, Node.js, npm's
    registry), so that a test never passes there by not running."""
    if os.environ.get("PRISM_TESTS_STRICT") == "1":
        pytest.fail(f"cannot run here, and PRISM_TESTS_STRICT=1: {reason}")
    pytest.skip(reason)


def laid_out(model: str, messages: list[dict], images: list[bytes]) -> tuple[list[int], list]:
    """A chat of text and images (`images`: their bytes, in order) as the processor lays it
    out for `kv` routing: the chat template's token ids, each image's placeholder expanded,
    and where each image lies (`kv_index.MediaSpan`)."""
    from transformers import AutoTokenizer

    from prism.kv_index import lay_out
    from prism.media.image import check_image
    from prism.media.policy import MediaPolicy
    from prism.media.prompt import PromptMedia
    from prism.services.processor.inputs import ModelInputs

    def parts(content: str | list[dict]) -> list[dict]:
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return [p if p["type"] == "text" else {"type": "image"} for p in content]

    conversation = [{"role": m["role"], "content": parts(m["content"])} for m in messages]
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(template, add_special_tokens=False)
    inputs = ModelInputs.of(model, enable_mm_embeds=False, count_tokens=True)
    media = PromptMedia([check_image(image, MediaPolicy(), "image") for image in images])
    return lay_out(prompt, inputs.placeholders, inputs.media_items(media))


# The parity cases: name -> (kind, messages or prompt, max_tokens). Oracle and mesh both
# see the same images as data URLs; tests may swap a data URL for an http URL of the same
# bytes.
CASES = {
    "one_image": ("chat", user(image_part(data_url(png(1))), "What is in this image?"), 16),
    "other_image": ("chat", user(image_part(data_url(png(2))), "What is in this image?"), 16),
    "three_images": (
        "chat",
        user(
            image_part(data_url(png(3))),
            "Compare",
            image_part(data_url(png(4))),
            "with",
            image_part(data_url(png(5))),
        ),
        16,
    ),
    "text_only": (
        "chat",
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the river."},
        ],
        16,
    ),
    "completion": ("completion", "The quick brown fox", 16),
}
# Parity cases of the families with a video path (VIDEO_FAMILIES): videos as data URLs.
VIDEO_FAMILIES = ("qwen2-vl",)
VIDEO_CASES = {
    "video": ("chat", user(video_part(data_url(video(1), "video/mp4")), "What happens?"), 16),
    "image_and_video": (
        "chat",
        user(
            image_part(data_url(png(6))),
            "and",
            video_part(data_url(video(2, container="webm"), "video/webm")),
            "Compare them.",
        ),
        16,
    ),
    "two_videos": (
        "chat",
        user(
            video_part(data_url(video(3), "video/mp4")),
            "then",
            video_part(data_url(video(4, frames=24, fps=12.0), "video/mp4")),
            "What changed?",
        ),
        16,
    ),
}


def openai_client(mesh: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)


def ask_case(mesh: Any, case: tuple, stream: bool) -> tuple[str, Any]:
    """One parity case (kind, messages or prompt, max_tokens[, sampling parameters])
    through the OpenAI SDK, greedy unless the case says otherwise: the answer's text and
    usage."""
    kind, body, max_tokens, *sampling = case
    client = openai_client(mesh)
    params = {"temperature": 0, "max_tokens": max_tokens, **(sampling[0] if sampling else {})}
    if kind == "chat":
        kwargs = dict(model=mesh.model, messages=body, **params)
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return reply.choices[0].message.content, reply.usage
        options = {"include_usage": True}
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options=options))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, chunks[-1].usage
    kwargs = dict(model=mesh.model, prompt=body, **params)
    if not stream:
        reply = client.completions.create(**kwargs)
        return reply.choices[0].text, reply.usage
    options = {"include_usage": True}
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options=options))
    return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage


# Video caps of the tests' meshes: low enough that tests can pass them with small videos.
VIDEO_CAPS = {"max_video_frames": 100, "max_video_seconds": 30, "max_video_pixels": 128 * 96}


# Words of the concurrent prompts: prompts that differ by a number only ("item 7") get the
# same answer from a random-weight model too often for swapped answers to show.
_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "window", "music", "paper", "silver",
    "forest", "candle", "bridge", "ocean", "winter", "market", "letter", "mountain", "coffee",
    "thunder", "needle", "castle", "pepper", "rabbit", "engine", "mirror", "harbor", "lemon",
    "planet", "violin", "meadow", "tunnel", "basket", "desert", "feather", "lantern",
    "orchard", "pillow", "saddle", "temple", "wagon", "yellow", "zebra", "anchor", "blanket",
    "cactus", "dragon",
)  # fmt: skip


def _concurrent_case(i: int) -> tuple:
    text = " ".join(random.Random(i).sample(_WORDS, 6))
    if i % 4 == 3:
        return ("completion", f"{text}:", 8)
    parts = [image_part(data_url(png(300 + i)))] if i % 2 else []
    return ("chat", user(*parts, f"{text}?"), 8)


# Sent all at once, 16 at a time (test_openai_sdk): each answer is its own and offline
# vLLM's, so that KV or embeddings crossing between concurrent requests show.
CONCURRENT_CASES = {f"concurrent_{i}": _concurrent_case(i) for i in range(64)}
# The first 16 again, sampled with a seed each: vLLM's answer to a seeded request is the
# same whatever else runs beside it.
SEEDED_CASES = {
    f"seeded_{i}": (*case, {"temperature": 1.0, "seed": 100 + i})
    for i, case in enumerate(list(CONCURRENT_CASES.values())[:16])
}


def assert_answers_differ(expected: dict[str, dict], names: Iterable[str] = CONCURRENT_CASES):
    """The expected answers to `names` differ, so that answers handed to the wrong requests
    would not equal theirs: at most one in 32 is the same as another's (a random-weight
    model's answers to different prompts may meet)."""
    texts = [expected[name]["text"] for name in names]
    same = [text for text, count in collections.Counter(texts).items() if count > 1]
    assert len(set(texts)) >= len(texts) - len(texts) // 32, same


def cases(family: str) -> dict[str, tuple]:
    """The parity cases of `family`."""
    return CASES | VIDEO_CASES if family in VIDEO_FAMILIES else CASES


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Here, not at the top: building imports torch, which the unit lane never loads.
    from prism.devtools.tiny_models import build

    root = tmp_path_factory.mktemp("models")
    return {family: build(family, root / family, seed=0) for family in FAMILIES}


def run_oracle(model: Path, tmp: Path, named: dict[str, tuple]) -> dict[str, dict]:
    # A case may add sampling parameters: (kind, body, max_tokens, {"temperature": ...}).
    cases = [
        {"kind": kind, "max_tokens": max_tokens, **(sampling[0] if sampling else {})}
        | ({"messages": body} if kind == "chat" else {"prompt": body})
        for kind, body, max_tokens, *sampling in named.values()
    ]
    cases_path = tmp / "cases.json"
    cases_path.write_text(json.dumps(cases))
    result = subprocess.run(
        [sys.executable, str(ROOT / "support" / "oracle.py"), str(model), str(cases_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("ORACLE ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"oracle failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return dict(zip(named, json.loads(lines[-1][len("ORACLE ") :]), strict=True))


@pytest.fixture(scope="session")
def oracle(models, tmp_path_factory):
    """oracle(family) -> {case name: {text, token_ids, prompt_tokens, finish_reason}}."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict[str, dict]:
        if family not in cache:
            tmp = tmp_path_factory.mktemp(f"o-{family}")
            named = cases(family) | CONCURRENT_CASES | SEEDED_CASES
            cache[family] = run_oracle(models[family], tmp, named)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def served(models, tmp_path_factory):
    """served(family) -> {parity case name: `vllm serve`'s answer} (tests/support/parity.py)."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict[str, dict]:
        if family not in cache:
            log = tmp_path_factory.mktemp(f"served-{family}") / "vllm-serve.log"
            cache[family] = parity.reference(str(models[family]), log)
        return cache[family]

    return get


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
        _template = Template(MODULES.values())
    return _template


def pytest_sessionfinish(session: pytest.Session) -> None:
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
        config.setdefault("vllm_flags", ["--max-num-seqs", str(ENGINE_MAX_NUM_SEQS)])
    config = mesh_config(
        mode,
        str(model),
        http_port=free_port(),
        **{"log_level": "warning", "fetch_allow": [ALLOWED_HOST], **VIDEO_CAPS, **config},
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


def stream_outcome(base_url: str, body: dict, timeout: float = 120) -> str:
    """How one streamed request ended: "completed" (every one of its `max_tokens`, with
    `ignore_eos`), "error CODE" (an HTTP error or an error event), "short N" (fewer tokens,
    no error), or "dropped: ..." (the connection broke)."""
    body = {**body, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    tokens = None
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
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return f"dropped: {exc!r}"
    return "completed" if tokens == body["max_tokens"] else f"short {tokens}"


def answer(mesh, case: str) -> tuple[str, int]:
    """Text and completion tokens of one parity case, greedy, as one JSON body."""
    kind, body, max_tokens = CASES[case]
    if kind == "chat":
        path, request = "chat/completions", {"messages": body}
    else:
        path, request = "completions", {"prompt": body}
    request |= {"model": mesh.model, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{mesh.base_url}/{path}", json=request, timeout=120)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    choice = reply["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return text, reply["usage"]["completion_tokens"]


def assert_equals_offline_vllm(mesh, expected: dict[str, dict]) -> None:
    for case in CASES:
        text, tokens = answer(mesh, case)
        assert (text, tokens) == (expected[case]["text"], len(expected[case]["token_ids"])), case


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


MESHES = [(family, mode) for family in FAMILIES for mode in MODES]


@pytest.fixture(
    scope="session", params=MESHES, ids=[f"{f}-{m.replace('/', '-')}" for f, m in MESHES]
)
def mesh(request, models, oracle, served, tmp_path_factory):
    """A mesh per family and mode; the family's oracle runs first (one engine at a time),
    and `vllm serve`'s answers to the parity cases when a parity test is to run."""
    family, mode = request.param
    oracle(family)
    parity_tests = ("test_openai_parity.py", "test_grpc_parity.py", "test_responses_parity.py")
    if any(item.path.name in parity_tests for item in request.session.items):
        served(family)
    # Tool calls parsed as `vllm serve` parses them for the parity cases.
    running = start_mesh(family, mode, models[family], tmp_path_factory.mktemp("logs"),
                         tool_call_parser="hermes", enable_auto_tool_choice=True)  # fmt: skip
    running.first_outcomes = first_requests(running)
    yield running
    running.stop()


class _ImageHandler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[bytes, str]]] = {}
    redirects: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        if self.path in self.redirects:
            self.send_response(302)
            self.send_header("Location", self.redirects[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, mime = self.routes.get(self.path, (b"not found", "text/plain"))
        self.send_response(200 if self.path in self.routes else 404)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


# Meshes and loaders in tests may fetch from this name, though it is loopback.
ALLOWED_HOST = "localhost"


@pytest.fixture(scope="session")
def image_server():
    """A loopback HTTP server: `serve(path, body, mime)` returns the URL of that body, on
    the host name the tests' meshes allow; `serve(path, location=URL)` redirects."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(path: str, body: bytes = b"", mime: str = "image/png", location: str = "") -> str:
        if location:
            _ImageHandler.redirects[path] = location
        else:
            _ImageHandler.routes[path] = (body, mime)
        return f"http://{ALLOWED_HOST}:{server.server_port}{path}"

    yield serve
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def reader():
    """A NIXL transfer agent in this process, the reading side of transfer tests."""
    from prism.transfer.nixl import NixlTransfer

    with NixlTransfer(pool_bytes=64 * 2**20) as agent:
        yield agent
