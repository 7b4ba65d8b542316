"""Prism in each mode against `vllm serve` on the same model, the same machine, the same load.

    .venv/bin/python bench/serve.py --model DIR [--load image|video]
        [--modes epd,e/pd,e/p/d,ep/d] [--concurrency 1,8,32] [--requests 256]
        [--max-tokens 32] [--out JSON] [--doc docs/benchmarks.md] [--profile DIR]
        [--rounds N] [--repeats 16]

Servers run one after the other: first vLLM's own OpenAI server (the anchor), then the
same with its engine as Prism's workers run it on the CPU backend (the model inside the
engine core process, so that the ratio to it is the mesh's own cost), then a
Prism mesh per mode; with `--rounds N`, all of them N times in turn, and the report gives
medians (each ratio the median of those measured within a round, beside its anchor).
Each gets the same fixed set of streaming chat requests, one image (or, with `--load
video`, one 16-frame video) each, at every concurrency level (a bounded count per level,
after a warm-up), from the asyncio client below: requests/s, output tokens/s, time to
first token and inter-token latency (p50, p99), and each Prism run's ratios to `vllm serve`
measured in the same run. For the modes that move tensors, the share of request time spent
in NIXL reads.
The video load measures the embedding cache too: `--repeats` videos, each sent twice at
concurrency 1 under different questions, and the time to first token of each sending.
Not a test: results go to `--out` (JSON; by default bench/results/latest.json for images,
bench/results/video.json for videos) and `--doc`, which shows both loads' latest results.
With `--profile`, py-spy records each Prism stage's Python process during the highest
concurrency level (of the last round) and writes one flame graph (SVG) per stage there.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import io
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import parity  # bench/parity.py, beside this file
import psutil
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from prism import gpus
from prism.config.common import LimitConfig, LogConfig, ModelConfig
from prism.config.stages import MeshConfig, ServeConfig
from prism.launcher import Mesh, core_slices, http_ok, plan, prepare_child
from prism.media.video import encode_video
from prism.ports import free_port
from prism.processes import reap

ANCHOR = "vllm_serve"
# `vllm serve` with the engine as Prism's workers run it on the CPU backend (the model
# inside the engine core process): the same engine on both sides, so the ratio to it is
# the mesh's own cost.
SAME_ENGINE = "vllm_serve_uni"
ANCHORS = (ANCHOR, SAME_ENGINE)
# With --anchors: each Prism mode beside the anchors of its shape (NVIDIA Dynamo's and
# vLLM's own disaggregation), and the disaggregation tax, each split mode beside EPD on
# the same cores.
SHAPES = {"epd": ("dynamo_agg",), "e/pd": ("dynamo_e_pd",), "ep/d": ("dynamo_pd", "vllm_pd")}
TAX = {"e/p/d": ("epd",), "ep/d": ("epd",)}
ANCHORS_RESULT = Path("bench/results/anchors.json")
ANCHORS_SECTION = "benchmarks-anchors.md"
# bench/scale.py's section.
SCALE_SECTION = "benchmarks-scale.md"
DYNAMO_PYTHON = Path(".anchors/dynamo/bin/python")
RESULTS = {"image": Path("bench/results/latest.json"), "video": Path("bench/results/video.json")}
# bench/routing.py's section of the benchmarks document, written beside it.
ROUTING_SECTION = "benchmarks-routing.md"
CHOICES_SECTION = "benchmarks-choices.md"
# bench/vllm_bench.py's: vLLM's own benchmark client against every mode.
VLLM_BENCH_SECTION = "benchmarks-vllm-bench.md"
# A short clip, every frame of which Qwen2-VL's loader takes (it samples 2 frames a second).
VIDEO_FRAMES, VIDEO_FPS = 16, 2.0


def slug(server: str) -> str:
    """A server's name in keys and file names: e/pd is e_pd, as epd is not e/p/d."""
    return server.replace("/", "_")


def image_url(seed: int) -> str:
    pixels = (np.random.RandomState(seed).rand(48, 64, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def video_url(seed: int) -> str:
    shape = (VIDEO_FRAMES, 48, 64, 3)
    frames = list((np.random.RandomState(seed).rand(*shape) * 255).astype("uint8"))
    with tempfile.TemporaryDirectory() as scratch:
        data = encode_video(frames, VIDEO_FPS, f"{scratch}/v.mp4")
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def media_part(load: str, seed: int) -> dict:
    if load == "video":
        return {"type": "video_url", "video_url": {"url": video_url(seed)}}
    return {"type": "image_url", "image_url": {"url": image_url(seed)}}


def chat(model: str, content: list[dict], max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def requests(model: str, seeds: range, max_tokens: int, load: str = "image") -> list[dict]:
    """A fixed load: a chat per seed, each with its own image or video and question."""
    return [
        chat(
            model,
            [
                media_part(load, seed),
                {"type": "text", "text": f"Question {seed}: what is in this {load}?"},
            ],
            max_tokens,
        )
        for seed in seeds
    ]


def repeats(model: str, seeds: range, max_tokens: int, load: str) -> list[list[dict]]:
    """Each seed's media sent twice, under different questions asked before it: the second
    sending shares no prompt prefix with the first past the chat template's."""
    return [
        [
            chat(
                model,
                [{"type": "text", "text": f"{ask} {seed}:"}, media_part(load, seed)],
                max_tokens,
            )
            for ask in ("Describe", "Summarize")
        ]
        for seed in seeds
    ]


class ServerFailed(RuntimeError):
    """A server answered a request with an error: its run stops, and the bench goes on."""


@dataclass
class Sample:
    ttft: float
    gaps: list[float]
    tokens: int
    total: float
    prompt_tokens: int = 0


async def one(session: aiohttp.ClientSession, url: str, body: dict) -> Sample:
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = prompt = 0
    async with session.post(url, json=body) as reply:
        if reply.status != 200:
            raise ServerFailed(f"{url}: HTTP {reply.status}: {(await reply.text())[:500]}")
        async for raw in reply.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if usage := event.get("usage"):
                tokens, prompt = usage["completion_tokens"], usage["prompt_tokens"]
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    ttft = (first or started) - started
    return Sample(ttft, gaps, tokens, time.perf_counter() - started, prompt)


async def drive(base_url: str, warm_up: list[dict], load: list[dict], concurrency: int) -> dict:
    url = f"{base_url}/v1/chat/completions"
    limit = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=limit, timeout=timeout) as session:
        # Connections and lazy set-up, outside the measurement.
        await asyncio.gather(*(one(session, url, body) for body in warm_up))
        queue = list(load)
        samples: list[Sample] = []

        async def worker() -> None:
            while queue:
                samples.append(await one(session, url, queue.pop()))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    ttfts = [s.ttft * 1000 for s in samples]
    gaps = [g * 1000 for s in samples for g in s.gaps]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "seconds": elapsed,
        "requests_per_s": len(samples) / elapsed,
        "output_tokens_per_s": sum(s.tokens for s in samples) / elapsed,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p99": percentile(gaps, 99),
        "request_seconds_total": sum(s.total for s in samples),
        # Under load a server may send several tokens in one event.
        "events_per_request": float(np.mean([len(s.gaps) + 1 for s in samples])),
    }


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels or set(sample.labels) <= {"tensor"}
    }


def counter(url: str, name: str) -> float:
    """The sum of a metric's samples (every label) on a /metrics page."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


def prompt_sources(url: str) -> dict[str, float]:
    """A vLLM engine's prompt tokens by where their KV came from (computed, its prefix
    cache, or read from another engine: "external_kv_transfer")."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    sources: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:prompt_tokens_by_source_total":
                source = sample.labels["source"]
                sources[source] = sources.get(source, 0.0) + sample.value
    return sources


@dataclass
class Server:
    name: str
    base_url: str
    # The model's name where the server does not serve it as the bench's --model.
    model: str = ""
    # /metrics of the stage that reads tensors over NIXL, to measure transfer time.
    reader_metrics: str = ""
    # /metrics of a vLLM decode engine, to tell how much of its prompts' KV it read.
    decode_metrics: str = ""
    stop: list = field(default_factory=list)
    # The Python process of each stage, to profile, and its /metrics.
    pids: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)
    # A Prism mesh's public gRPC API.
    grpc_address: str = ""


# UCX (under NIXL) on loopback alone, as everything the bench starts.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
            "UCX_NET_DEVICES": "lo"}  # fmt: skip
# vLLM's KV connector for a prefill/decode split, as Prism's engines and Dynamo's use it.
NIXL = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def spawn(
    argv: list[str], log: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> subprocess.Popen:
    """A server process in a group of its own (stopped with all its children), on `cpus`
    if given, that dies with the bench."""
    prepare = functools.partial(prepare_child, cpus or set())
    with open(log, "a") as out:
        return subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=out,
                                stderr=subprocess.STDOUT, process_group=0,
                                preexec_fn=prepare)  # fmt: skip


def stop_all(processes: list[subprocess.Popen]) -> None:
    """Stops `processes` and every process they started, wherever its group: none may
    outlive its server and answer on a port the next server is given."""
    tree = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            tree += psutil.Process(process.pid).children(recursive=True)
    for process in reversed(processes):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            reap(process)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for survivor in alive:
        with contextlib.suppress(psutil.Error):
            survivor.kill()


def await_ready(
    ready: Callable[[], bool], processes: list[subprocess.Popen], what: str, log: Path
) -> None:
    """Waits for `ready`; on failure or interruption (Ctrl-C), stops `processes` whole."""
    deadline = time.monotonic() + 300
    try:
        while not ready():
            if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start; see {log}")
            time.sleep(0.5)
    except BaseException:
        stop_all(processes)
        raise


def vllm_argv(model: str, port: int, limits: dict) -> list[str]:
    # The anchor's engine as Prism's workers run theirs: float32 and eager on the CPU
    # backend; on a GPU, the checkpoint's dtype with CUDA graphs.
    engine = [] if gpus.visible_gpus() else ["--dtype", "float32", "--enforce-eager"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            *engine, "--seed", "0", "--port", str(port),
            "--host", "127.0.0.1", "--limit-mm-per-prompt", json.dumps(limits),
            "--uvicorn-log-level", "warning"]  # fmt: skip


def start_vllm(model: str, log: Path, limits: dict, same_engine: bool = False) -> Server:
    port = free_port()
    argv = vllm_argv(model, port, limits)
    env = dict(VLLM_ENV)
    if same_engine:
        argv += ["--distributed-executor-backend", "uni"]
        # As many OpenMP threads as vLLM binds on one node (all cores but its scheduler's).
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads)}
    # In this session, as Prism's stages are: the kernel shares CPU between sessions.
    processes = [spawn(argv, log, env)]
    base_url = f"http://127.0.0.1:{port}"
    await_ready(lambda: http_ok(f"{base_url}/health"), processes, "vllm serve", log)
    name = SAME_ENGINE if same_engine else ANCHOR
    return Server(name, base_url, stop=[lambda: stop_all(processes)])


def pinned(cores: set[int]) -> dict[str, str]:
    """The OpenMP binding of an engine kept to `cores`, as Prism's launcher pins its own."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(cores)))}


def start_vllm_pd(model: str, logs: Path, limits: dict) -> Server:
    """Two `vllm serve` engines with the NixlConnector, on the cores Prism's prefill and
    decode get, behind bench/pd_proxy.py."""
    processes: list[subprocess.Popen] = []
    urls = []
    log = logs / "vllm-pd.log"
    for cores in core_slices(2):
        port = free_port()
        env = VLLM_ENV | pinned(cores) | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        argv = [*vllm_argv(model, port, limits), "--kv-transfer-config", NIXL]
        processes.append(spawn(argv, log, env, cores))
        urls.append(f"http://127.0.0.1:{port}")
    for url in urls:
        await_ready(lambda url=url: http_ok(f"{url}/health"), processes, "vLLM P/D", log)
    port = free_port()
    proxy = [sys.executable, str(Path(__file__).with_name("pd_proxy.py")), "--port", str(port),
             "--prefill", urls[0], "--decode", urls[1]]  # fmt: skip
    processes.append(spawn(proxy, log))
    base_url = f"http://127.0.0.1:{port}"
    await_ready(lambda: http_ok(f"{base_url}/health"), processes, "vLLM P/D proxy", log)
    return Server("vllm_pd", base_url, decode_metrics=f"{urls[1]}/metrics",
                  stop=[lambda: stop_all(processes)])  # fmt: skip


DYNAMO_AGG, DYNAMO_PD, DYNAMO_E_PD = "dynamo_agg", "dynamo_pd", "dynamo_e_pd"


def dynamo_env(logs: Path) -> dict[str, str]:
    """Dynamo without etcd or NATS: file discovery in a fresh directory, TCP requests,
    ZMQ events, all on loopback."""
    store = Path(tempfile.mkdtemp(prefix="dynamo-kv-", dir=logs))
    return VLLM_ENV | {
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store),
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_LOG": "warn",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    }  # fmt: skip


def start_dynamo(shape: str, model: str, logs: Path, limits: dict) -> Server:
    """NVIDIA Dynamo's frontend and `dynamo.vllm` workers in one of its shapes. Two
    engines get a core each, as Prism's launcher places its own."""
    env = dynamo_env(logs)
    log = logs / f"{shape}.log"
    python = str(DYNAMO_PYTHON)
    worker = [python, "-m", "dynamo.vllm", "--model", model, "--enable-multimodal",
              "--enforce-eager", "--dtype", "float32", "--seed", "0",
              "--limit-mm-per-prompt", json.dumps(limits)]  # fmt: skip
    roles = {
        DYNAMO_AGG: [[]],
        DYNAMO_PD: [["--disaggregation-mode", "prefill", "--kv-transfer-config", NIXL],
                    ["--disaggregation-mode", "decode", "--kv-transfer-config", NIXL]],
        # Its default embedding transfer reserves 8 GiB in the PD worker; reads do not.
        DYNAMO_E_PD: [["--disaggregation-mode", "encode", "--embedding-transfer-mode", "nixl-read"],
                      ["--route-to-encoder", "--enable-mm-embeds",
                       "--embedding-transfer-mode", "nixl-read"]],
    }[shape]  # fmt: skip
    processes = []
    slices = core_slices(len(roles)) if len(roles) > 1 else [set()]
    for flags, cores in zip(roles, slices, strict=True):
        placed = env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        if cores:
            placed |= pinned(cores)
        processes.append(spawn([*worker, *flags], log, placed, cores))
    port = free_port()
    frontend = [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                "--http-port", str(port)]  # fmt: skip
    processes.append(spawn(frontend, log, env))
    base_url = f"http://127.0.0.1:{port}"
    await_ready(lambda: bool(served_models(base_url)), processes, shape, log)
    return Server(shape, base_url, model=served_models(base_url)[0],
                  stop=[lambda: stop_all(processes)])  # fmt: skip


def served_models(base_url: str) -> list[str]:
    """What /v1/models lists: a Dynamo frontend lists a model once a worker serves it."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=2) as reply:
            return [entry["id"] for entry in json.load(reply)["data"]]
    except (OSError, ValueError, KeyError):
        return []


class AnchorFailed(RuntimeError):
    """An anchor that does not run on this machine: the bench goes on without it."""


def anchor(start: Callable[[], Server], name: str) -> Callable[[], Server]:
    def started() -> Server:
        try:
            return start()
        except RuntimeError as exc:
            raise AnchorFailed(f"{name}: {exc}") from exc

    return started


def start_prism(mode: str, model: str, log: Path, **serve: Any) -> Server:
    """A mesh of `mode`; `serve`, fields of its ServeConfig (prefill_workers=2)."""
    port, grpc_port = free_port(), free_port()
    config = MeshConfig(ModelConfig(model),
                        ServeConfig(mode, http_port=port, grpc_port=grpc_port, **serve),
                        limit=LimitConfig(0), log=LogConfig("warning"))  # fmt: skip
    mesh = Mesh(plan(config))
    with open(log, "w") as out:
        mesh.start(timeout=300, log=out)
    reader = {"e/pd": "worker", "e/p/d": "prefill"}.get(mode, "")
    metrics = mesh.stage(reader).metrics_url if reader else ""
    pids = {stage.name: stage.process.pid for stage in mesh.stages if stage.process}
    return Server(
        mode, f"http://127.0.0.1:{port}", reader_metrics=metrics, stop=[mesh.stop], pids=pids,
        metrics={stage.name: stage.metrics_url for stage in mesh.stages},
        grpc_address=f"127.0.0.1:{grpc_port}",
    )  # fmt: skip


def profiled(server: Server, profile: Path | None) -> list[subprocess.Popen]:
    """py-spy recorders, one per stage process; SIGINT makes each write its flame graph."""
    if profile is None:
        return []
    profile.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    name = slug(server.name)
    recorders = []
    for stage, pid in server.pids.items():
        argv = [str(spy), "record", "--pid", str(pid), "--rate", "100", "--nonblocking",
                "--output", str(profile / f"{name}-{stage}.svg")]  # fmt: skip
        recorders.append(subprocess.Popen(argv, stderr=subprocess.DEVNULL))
    return recorders


def tree_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process and its children have used so far."""
    out = {}
    for name, pid in pids.items():
        total = 0.0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
        out[name] = total
    return out


def run_server(
    server: Server, loads: dict[int, tuple[list, list]], profile: Path | None = None
) -> list[dict]:
    rows = []
    for concurrency, (warm_up, load) in loads.items():
        before = scrape(server.reader_metrics) if server.reader_metrics else {}
        sources = prompt_sources(server.decode_metrics) if server.decode_metrics else {}
        recorders = profiled(server, profile) if concurrency == max(loads) else []
        if server.model:
            warm_up = [body | {"model": server.model} for body in warm_up]
            load = [body | {"model": server.model} for body in load]
        cpu = tree_cpu_seconds(server.pids)
        row = asyncio.run(drive(server.base_url, warm_up, load, concurrency))
        if server.pids:
            # Each stage's CPU (its engine's processes included), warm-up and load.
            spent = tree_cpu_seconds(server.pids)
            row["cpu_ms_per_request"] = {
                stage: 1000 * (spent[stage] - cpu[stage]) / (len(warm_up) + len(load))
                for stage in spent
            }
        for recorder in recorders:
            recorder.send_signal(signal.SIGINT)
        for recorder in recorders:
            recorder.wait(timeout=60)
        if server.reader_metrics:
            after = scrape(server.reader_metrics)
            name = "prism_nixl_read_seconds_sum"
            read = after.get(name, 0.0) - before.get(name, 0.0)
            row["nixl_read_share"] = read / row["request_seconds_total"]
        if server.decode_metrics:
            after = prompt_sources(server.decode_metrics)
            read = after.get("external_kv_transfer", 0) - sources.get("external_kv_transfer", 0)
            total = sum(after.values()) - sum(sources.values())
            # A decode that computed the prompts itself would not be a P/D split.
            row["decode_kv_read_share"] = read / total if total else 0.0
        row["server"] = server.name
        rows.append(row)
        print(f"{server.name:>10} c={concurrency:<3} {row['requests_per_s']:7.2f} req/s "
              f"{row['output_tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_ms_p50']:7.1f} ms "
              f"ITL p50 {row['itl_ms_p50']:6.2f} ms", flush=True)  # fmt: skip
    return rows


async def resend(base_url: str, pairs: list[list[dict]]) -> dict:
    """Time to first token of each media's first sending and of its second, one at a time."""
    url = f"{base_url}/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        ttfts = [[(await one(session, url, body)).ttft * 1000 for body in pair] for pair in pairs]
    first, repeat = zip(*ttfts, strict=True)
    return {
        "concurrency": 1,
        "requests": len(pairs),
        "ttft_ms_p50_first": percentile(list(first), 50),
        "ttft_ms_p50_repeat": percentile(list(repeat), 50),
    }


def suffix(concurrency: int, top: int) -> str:
    """Ratios at the highest level have plain keys; the others end in _c<level>."""
    return "" if concurrency == top else f"_c{concurrency}"


Pair = tuple[str, str]


def anchor_pairs(rows: list[dict]) -> list[Pair]:
    """Every server beside each `vllm serve` anchor that ran."""
    servers = list(dict.fromkeys(r["server"] for r in rows))
    return [(server, anchor) for anchor in ANCHORS if anchor in servers
            for server in servers if server != anchor]  # fmt: skip


def shape_pairs(rows: list[dict]) -> list[Pair]:
    """Each Prism mode beside the anchors of its shape that ran, and the disaggregation
    tax: each split mode beside EPD."""
    servers = {r["server"] for r in rows}
    pairs = [(mode, anchor) for table in (SHAPES, TAX) for mode, anchors in table.items()
             for anchor in anchors if {mode, anchor} <= servers]  # fmt: skip
    return pairs + [(s, ANCHOR) for s in sorted(servers) if s != ANCHOR and ANCHOR in servers]


def ratios(rows: list[dict], pairs: list[Pair] | None = None) -> dict[str, float]:
    """Each server's requests/s and output tokens/s over its anchor's, and its TTFT p50
    minus the anchor's, at every level both ran (`pairs`: server and anchor; default:
    every server beside each `vllm serve`)."""
    by = {(r["server"], r["concurrency"]): r for r in rows}
    top = max(r["concurrency"] for r in rows)
    out = {}
    for server, anchor in anchor_pairs(rows) if pairs is None else pairs:
        for concurrency in sorted({c for _, c in by}):
            row, base = by.get((server, concurrency)), by.get((anchor, concurrency))
            if row is None or base is None:
                continue
            name = f"{slug(server)}_vs_{slug(anchor)}"
            end = suffix(concurrency, top)
            out[f"{name}_rps_ratio{end}"] = row["requests_per_s"] / base["requests_per_s"]
            out[f"{name}_tokens_ratio{end}"] = (
                row["output_tokens_per_s"] / base["output_tokens_per_s"]
            )
            out[f"{slug(server)}_minus_{slug(anchor)}_ttft_p50_ms{end}"] = (
                row["ttft_ms_p50"] - base["ttft_ms_p50"]
            )
    return out


def medians(rounds: list[list[dict]]) -> list[dict]:
    """Per server and level, the median of each measure over the rounds, and the
    requests/s of every round."""
    rows = []
    for first in rounds[0]:
        which = (first["server"], first["concurrency"])
        same = [r for rows in rounds for r in rows if (r["server"], r["concurrency"]) == which]
        row = {
            key: float(np.median([r[key] for r in same])) if isinstance(value, float) else value
            for key, value in first.items()
        }
        if "requests_per_s" in first:
            row["requests_per_s_by_round"] = [r["requests_per_s"] for r in same]
        rows.append(row)
    return rows


def median_ratios(
    rounds: list[list[dict]], pairs: Callable[[list[dict]], list[Pair]] = anchor_pairs
) -> dict[str, float]:
    """Each ratio taken within a round, against the anchor run beside it; then the median."""
    per_round = [ratios(rows, pairs(rows)) for rows in rounds]
    return {key: float(np.median([r[key] for r in per_round])) for key in per_round[0]}


def plots(path: Path, rows: list[dict]) -> list[str]:
    """PNG plots of the image load beside `path`, and the markdown that shows them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = list(dict.fromkeys(r["server"] for r in rows))
    shown = []
    for key, label, name in (("requests_per_s", "requests/s", "rps"),
                             ("ttft_ms_p50", "TTFT p50 (ms)", "ttft"),
                             ("itl_ms_p50", "inter-token latency p50 (ms)", "itl")):  # fmt: skip
        figure, axes = plt.subplots(figsize=(6, 4))
        for server in servers:
            points = [(r["concurrency"], r[key]) for r in rows if r["server"] == server]
            axes.plot(*zip(*points, strict=True), marker="o", label=server)
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.legend()
        axes.grid(alpha=0.3)
        image = path.parent / f"benchmarks-{name}.png"
        figure.tight_layout()
        figure.savefig(image, dpi=110)
        plt.close(figure)
        shown.append(f"![{label}]({image.name})")
    return shown


def table(result: dict) -> list[str]:
    """One row per server and level, with ratios to each anchor that ran."""
    rows = result["rows"]
    anchors = [a for a in ANCHORS if any(r["server"] == a for r in rows)]
    names = {ANCHOR: "vllm serve", SAME_ENGINE: "vllm serve, same engine"}
    lines = [
        "| server | concurrency | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms "
        "| ITL p99 ms | "
        + "".join(f"req/s vs {names[a]} | " for a in anchors)
        + "NIXL read share |",
        "|---|" + "---:|" * (8 + len(anchors)),
    ]
    top = max(r["concurrency"] for r in rows if r["server"] == ANCHOR)
    for r in rows:
        end = suffix(r["concurrency"], top)
        ratios = [
            1.0 if r["server"] == anchor else result.get(
                f"{slug(r['server'])}_vs_{anchor}_rps_ratio{end}", float("nan"))
            for anchor in anchors
        ]  # fmt: skip
        share = f"{100 * r['nixl_read_share']:.2f} %" if "nixl_read_share" in r else ""
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests_per_s']:.2f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} "
            f"| {r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} | "
            + "".join(f"{ratio:.2f} | " for ratio in ratios)
            + f"{share} |"
        )
    return lines


def setting(result: dict, what: str) -> str:
    return (
        f"Written by `make bench` on {result['when']} ({result['machine']}). Model: "
        f"{result['model']}; {result['requests']} streaming chat requests per level, {what} "
        f"each, {result['max_tokens']} tokens each, greedy. Every level has "
        "requests of its own (no prefix or media cache hits across levels), after a warm-up "
        "burst of its own. The client runs on the same machine. "
        f"Rounds: {result['rounds']}. In each round every server runs once, in turn; the "
        "table gives medians over the rounds, and each ratio is the median of the ratios "
        "measured within a round."
    )


# The goals of docs/benchmarks.md, each checked where it was measured.
RPS_GOAL, TTFT_GOAL_MS, TAX_GOAL = 1.0, 2.0, 0.8


def anchors_section(result: dict) -> str:
    """Each Prism mode beside the anchors of its shape, and the disaggregation tax."""
    names = {ANCHOR: "vllm serve", "dynamo_agg": "Dynamo aggregated", "dynamo_pd": "Dynamo P/D",
             "dynamo_e_pd": "Dynamo E/PD", "vllm_pd": "vLLM P/D (NixlConnector + proxy)",
             "epd": "Prism EPD"}  # fmt: skip
    levels = sorted({r["concurrency"] for r in result["rows"]})
    top = max(levels)
    lines = [
        "## Beside NVIDIA Dynamo and vLLM's own P/D", "",
        setting(result, "one 64x48 image").replace("`make bench`", "`make bench-anchors`"), "",
        "Anchors: NVIDIA Dynamo 1.6.1 (`dynamo.frontend` and `dynamo.vllm` on vLLM 0.31 for "
        "the CPU, in .anchors/dynamo: file discovery, TCP requests, ZMQ events; aggregated, "
        "P/D with the NixlConnector, and E/PD with its encode worker), vLLM's own P/D (two "
        "`vllm serve` with the NixlConnector behind bench/pd_proxy.py, the protocol of vLLM's "
        "toy proxy) and `vllm serve`. Engines sit on cores the same way on every side: one "
        "engine keeps vLLM's own binding; a prefill and a decode get a core each.", "",
        *table(result), "",
        "Each Prism mode beside the anchor of its shape (requests/s ratio; TTFT p50 "
        "difference, ms), and the disaggregation tax (each split mode beside Prism EPD):", "",
        "| Prism | beside | " + " | ".join(f"req/s c={c}" for c in levels) + " | "
        + " | ".join(f"TTFT p50 ms c={c}" for c in levels) + " | goal | met |",
        "|---|---|" + "---:|" * (2 * len(levels)) + "---|---|",
    ]  # fmt: skip
    for mode, other in shape_pairs(result["rows"]):
        # `vllm serve` is of EPD's shape alone.
        if other == ANCHOR and mode != "epd":
            continue
        name = f"{slug(mode)}_vs_{slug(other)}"
        rps = [result.get(f"{name}_rps_ratio{suffix(c, top)}") for c in levels]
        ttft = [result.get(f"{slug(mode)}_minus_{slug(other)}_ttft_p50_ms{suffix(c, top)}")
                for c in levels]  # fmt: skip
        if mode in TAX and other in TAX[mode]:
            goal = f"req/s at c={top} ≥ {TAX_GOAL:.1f}x EPD"
            met = rps[-1] is not None and rps[-1] >= TAX_GOAL
        else:
            goal = (
                f"req/s at c={top} ≥ {RPS_GOAL:.1f}x; "
                f"TTFT p50 at c={levels[0]} ≤ +{TTFT_GOAL_MS:g} ms"
            )
            met = (rps[-1] or 0) >= RPS_GOAL and (
                ttft[0] if ttft[0] is not None else 1e9
            ) <= TTFT_GOAL_MS
        lines.append(
            f"| {mode} | {names.get(other, other)} | "
            + " | ".join("" if v is None else f"{v:.2f}" for v in rps)
            + " | "
            + " | ".join("" if v is None else f"{v:+.1f}" for v in ttft)
            + f" | {goal} | {'yes' if met else '**no**'} |"
        )
    if result.get("not_run"):
        lines += ["", "Not run here: " + "; ".join(result["not_run"]) + "."]
    notes = Path("docs") / "benchmarks-anchors-notes.md"
    if notes.exists():
        lines += ["", notes.read_text()]
    return "\n".join(lines) + "\n"


def write_section(doc: Path, name: str, text: str) -> None:
    """Writes a benchmark's section `name` beside `doc`, then `doc` again with it."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    (doc.parent / name).write_text(text)
    shown = {load: json.loads(path.read_text()) for load, path in RESULTS.items() if path.exists()}
    write_doc(doc, shown)


def write_doc(path: Path, results: dict[str, dict]) -> None:
    """The latest result of each load, images first (with the notes written beside it),
    then the sections of the routing and choices benchmarks (bench/routing.py,
    bench/choices.py) that have run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# Benchmarks: Prism against `vllm serve`", ""]
    if image := results.get("image"):
        lines += [setting(image, "one 64x48 image"), "", *table(image), ""]
        lines += [*plots(path, image["rows"]), ""]
        notes = path.parent / "benchmarks-notes.md"
        if notes.exists():
            lines += [notes.read_text()]
    if video := results.get("video"):
        clip = (
            f"one {VIDEO_FRAMES}-frame 64x48 MP4 video (MPEG-4, {VIDEO_FPS:g} frames a "
            "second, every frame taken by the model's video loader)"
        )
        lines += ["## Video load", "", setting(video, clip), "", *table(video), ""]
    if video and video["resent"]:
        lines += [
            "**A video sent again.** Each of "
            f"{video['resent'][0]['requests']} new videos sent twice, one request at a time, "
            "each sending under its own question asked before the video (so the second "
            "shares no prompt prefix with the first past the chat template's); time to "
            "first token, p50:",
            "",
            "| server | first sending, ms | sent again, ms |",
            "|---|---:|---:|",
            *(
                f"| {r['server']} | {r['ttft_ms_p50_first']:.1f} | {r['ttft_ms_p50_repeat']:.1f} |"
                for r in video["resent"]
            ),
            "",
        ]
    sections = (ANCHORS_SECTION, SCALE_SECTION, ROUTING_SECTION, CHOICES_SECTION,
                VLLM_BENCH_SECTION)  # fmt: skip
    for section in sections:
        if (path.parent / section).exists():
            lines += [(path.parent / section).read_text()]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--modes", default="epd,e/pd,e/p/d,ep/d")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=256, help="per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--load", choices=tuple(RESULTS), default="image")
    parser.add_argument(
        "--repeats", type=int, default=16, help="video load: videos sent twice (cache hits)"
    )
    parser.add_argument("--out", type=Path, help="default: bench/results/<load>.json")
    parser.add_argument("--doc", default="docs/benchmarks.md")
    parser.add_argument("--profile", type=Path, help="write py-spy flame graphs here")
    parser.add_argument("--rounds", type=int, default=1,
                        help="each server runs once per round, in turn; medians")  # fmt: skip
    parser.add_argument(
        "--anchors",
        action="store_true",
        help="NVIDIA Dynamo (aggregated, P/D, E/PD) and vLLM's own P/D beside `vllm serve` "
        "and Prism (set up by `make bench-anchors`); default --out: bench/results/anchors.json",
    )
    parser.add_argument("--doc-only", action="store_true",
                        help="rewrite --doc from the results files, running nothing")  # fmt: skip
    parser.add_argument(
        "--same-engine", action=argparse.BooleanOptionalAction, default=True,
        help="image load: also `vllm serve` with its engine as Prism's workers run it on the CPU",
    )  # fmt: skip
    parser.add_argument(
        "--parity", default="", metavar="MODES",
        help="these Prism modes' greedy answers to --parity-prompts image prompts "
        "(--parity-tokens each) beside one offline vLLM engine's (bench/parity.py)",
    )  # fmt: skip
    parser.add_argument("--parity-prompts", type=int, default=4)
    parser.add_argument("--parity-tokens", type=int, default=16)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.doc_only:
        if ANCHORS_RESULT.exists():
            anchors = json.loads(ANCHORS_RESULT.read_text())
            (Path(args.doc).parent / ANCHORS_SECTION).write_text(anchors_section(anchors))
        import scale  # bench/scale.py, beside this file

        if scale.RESULT.exists():
            result = json.loads(scale.RESULT.read_text())
            (Path(args.doc).parent / SCALE_SECTION).write_text(scale.section(result))
        shown = {load: json.loads(p.read_text()) for load, p in RESULTS.items() if p.exists()}
        write_doc(Path(args.doc), shown)
        return

    def loads(round_: int) -> dict[int, tuple[list, list]]:
        # Every level of every round gets requests of its own, and so does its warm-up:
        # none can be served from a prefix or image cache that an earlier one filled.
        # Each server gets the same.
        out = {}
        for level, concurrency in enumerate(levels):
            first = round_ * 10_000_000 + (level + 1) * 100_000
            warm_up = requests(
                args.model, range(first, first + concurrency), args.max_tokens, args.load
            )
            first += concurrency
            load = requests(
                args.model, range(first, first + args.requests), args.max_tokens, args.load
            )
            out[concurrency] = (warm_up, load)
        return out

    def pairs(round_: int) -> list[list[dict]]:
        first = round_ * 10_000_000 + 9_000_000
        return repeats(args.model, range(first, first + args.repeats), args.max_tokens, args.load)

    logs = Path(tempfile.mkdtemp(prefix="prism-bench-"))
    # The same caps as a Prism mesh's defaults (--max-images 8, --max-videos 4).
    limits = {"image": 8} if args.load == "image" else {"image": 8, "video": 4}
    starters = [lambda: start_vllm(args.model, logs / "vllm-serve.log", limits)]
    if args.anchors:
        if not DYNAMO_PYTHON.exists():
            raise SystemExit("the anchors are not installed: run `make bench-anchors`")
        starters += [
            anchor(lambda: start_dynamo(DYNAMO_AGG, args.model, logs, limits), DYNAMO_AGG),
            anchor(lambda: start_dynamo(DYNAMO_PD, args.model, logs, limits), DYNAMO_PD),
            anchor(lambda: start_dynamo(DYNAMO_E_PD, args.model, logs, limits), DYNAMO_E_PD),
            anchor(lambda: start_vllm_pd(args.model, logs, limits), "vllm_pd"),
        ]
    elif args.load == "image" and args.same_engine:
        starters.append(
            lambda: start_vllm(args.model, logs / "vllm-serve-uni.log", limits, same_engine=True)
        )
    starters += [
        lambda mode=mode: start_prism(mode, args.model, logs / f"{slug(mode)}.log")
        for mode in args.modes.split(",")
    ]
    checked = set(filter(None, args.parity.split(",")))
    # First, while no server holds the machine's memory.
    expected = parity.oracle(args.model, args.parity_prompts, args.parity_tokens) if checked else []
    parities: dict[str, list[dict]] = {}
    rounds: list[list[dict]] = []
    resent: list[list[dict]] = []
    # Anchors that could not start here, and why.
    failed: dict[int, str] = {}
    for round_ in range(args.rounds):
        profile = args.profile if round_ == args.rounds - 1 else None
        rows: list[dict] = []
        resends: list[dict] = []
        for index, start in enumerate(starters):
            if index in failed:
                continue
            try:
                server = start()
            except AnchorFailed as exc:
                failed[index] = str(exc)
                print(f"skipped: {exc}", flush=True)
                continue
            try:
                if server.name in checked and server.name not in parities:
                    got = parity.answers(
                        server.grpc_address, args.model, args.parity_prompts, args.parity_tokens
                    )
                    parities[server.name] = parity.compare(expected, got)
                    equal = sum(row["equal"] for row in parities[server.name])
                    print(f"{server.name:>10} parity: {equal}/{len(got)} prompts equal to "
                          "the offline engine", flush=True)  # fmt: skip
                rows += run_server(server, loads(round_), profile)
                if args.load == "video" and args.repeats:
                    row = asyncio.run(resend(server.base_url, pairs(round_)))
                    resends.append(row | {"server": server.name})
                    first, again = row["ttft_ms_p50_first"], row["ttft_ms_p50_repeat"]
                    print(f"{server.name:>10} resent: TTFT p50 {first:.1f} ms first, "
                          f"{again:.1f} ms again", flush=True)  # fmt: skip
            except ServerFailed as exc:
                failed[index] = f"{server.name} failed: {exc}"
                print(failed[index], flush=True)
            finally:
                for stop in server.stop:
                    stop()
        rounds.append(rows)
        resent.append(resends)
    # A server that failed in any round is left out of every round.
    everywhere = set.intersection(*({r["server"] for r in rows} for rows in rounds))
    rounds = [[r for r in rows if r["server"] in everywhere] for rows in rounds]
    rows = medians(rounds)
    pairs = shape_pairs if args.anchors else anchor_pairs
    result = {
        "load": args.load,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "model": args.model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "rows": rows,
        "resent": medians(resent) if resent[0] else [],
        "not_run": sorted(failed.values()),
        **median_ratios(rounds, pairs),
    }
    if checked:
        result["parity"] = {
            "prompts": args.parity_prompts, "max_tokens": args.parity_tokens, "modes": parities,
        }  # fmt: skip
    out = args.out or (ANCHORS_RESULT if args.anchors else RESULTS[args.load])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    shown = {load: json.loads(path.read_text()) for load, path in RESULTS.items() if path.exists()}
    if args.anchors:
        (Path(args.doc).parent / ANCHORS_SECTION).write_text(anchors_section(result))
    else:
        shown[args.load] = result
    write_doc(Path(args.doc), shown)
    print(json.dumps({k: round(v, 3) for k, v in median_ratios(rounds, pairs).items()}, indent=2))
    print(f"logs in {logs}")


if __name__ == "__main__":
    main()
