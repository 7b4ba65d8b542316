"""The servers the benchmarks measure, each started on this machine and stopped whole:
`vllm serve` (the anchor), vLLM's own P/D behind bench/pd_proxy.py, NVIDIA Dynamo in its
shapes, and a Prism mesh per mode."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
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

import psutil

from bench.lib.shapes import ANCHOR, DYNAMO_AGG, DYNAMO_E_PD, DYNAMO_PD, SAME_ENGINE
from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import LimitConfig, LogConfig, ModelConfig
from prism.config.gateway import GatewayConfig, HttpConfig
from prism.config.lora import LoraConfig
from prism.ops import gpus
from prism.ops.launcher import Mesh
from prism.ops.plan import plan
from prism.ops.stage_process import core_slices, http_ok, prepare_child
from prism.runtime.ports import free_port
from prism.runtime.processes import reap

# Set up by `make bench-anchors` (scripts/bench_anchors.sh).
DYNAMO_PYTHON = Path(".anchors/dynamo/bin/python")


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


def start_vllm(
    model: str, log: Path, limits: dict, same_engine: bool = False, extra: tuple[str, ...] = ()
) -> Server:
    """`vllm serve` on `model`, with `extra` flags (its LoRA adapters)."""
    port = free_port()
    argv = [*vllm_argv(model, port, limits), *extra]
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
    proxy = [sys.executable, "-m", "bench.pd_proxy", "--port", str(port),
             "--prefill", urls[0], "--decode", urls[1]]  # fmt: skip
    processes.append(spawn(proxy, log))
    base_url = f"http://127.0.0.1:{port}"
    await_ready(lambda: http_ok(f"{base_url}/health"), processes, "vLLM P/D proxy", log)
    return Server("vllm_pd", base_url, decode_metrics=f"{urls[1]}/metrics",
                  stop=[lambda: stop_all(processes)])  # fmt: skip


def dynamo_env(logs: Path, etcd: str = "") -> dict[str, str]:
    """Dynamo without NATS: file discovery in a fresh directory (or the etcd at `etcd`,
    which its planner needs), TCP requests, ZMQ events, all on loopback."""
    if etcd:
        discovery = {"DYN_DISCOVERY_BACKEND": "etcd", "ETCD_ENDPOINTS": etcd}
    else:
        store = Path(tempfile.mkdtemp(prefix="dynamo-kv-", dir=logs))
        discovery = {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store)}
    return VLLM_ENV | discovery | {
        "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_LOG": "warn",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    }  # fmt: skip


def start_etcd(logs: Path) -> tuple[subprocess.Popen, str]:
    """An etcd of its own on loopback ports, its data in a fresh directory under `logs`
    (Dynamo's planner publishes its decisions there); the process and its client URL."""
    if shutil.which("etcd") is None:
        raise SystemExit("etcd is not installed: `apt-get install etcd-server` (etcd 3.4)")
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    data = tempfile.mkdtemp(prefix="etcd-", dir=logs)
    argv = ["etcd", "--data-dir", data, "--listen-client-urls", client,
            "--advertise-client-urls", client, "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"default={peer}"]  # fmt: skip
    log = logs / "etcd.log"
    process = spawn(argv, log)
    await_ready(lambda: http_ok(f"{client}/health"), [process], "etcd", log)
    return process, client


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


class StartFailed(RuntimeError):
    """A server that did not start on this machine: the bench goes on without it and
    records why."""


def may_fail(start: Callable[[], Server], name: str) -> Callable[[], Server]:
    def started() -> Server:
        try:
            return start()
        except RuntimeError as exc:
            raise StartFailed(f"{name}: {exc}") from exc

    return started


# A line that starts an exception's report: `package.module.NameError: message`.
_EXCEPTION = re.compile(r"^\w[\w.]*(Error|Exception)\b")


def start_prism(
    mode: str,
    model: str,
    log: Path,
    vllm_flags: tuple[str, ...] = (),
    lora_modules: tuple[str, ...] = (),
    log_level: str = "warning",
    gateway: GatewayConfig | None = None,
    **serve: Any,
) -> Server:
    """A mesh of `mode`; `serve`, fields of its ServeConfig (prefill_workers=2); `gateway`,
    its fronts' settings (where they keep batches);
    `vllm_flags`, vLLM's engine arguments for every engine (--enforce-eager);
    `lora_modules`, its LoRA adapters (NAME=PATH); `log_level`, its stages' (`info`: each
    stage's start phase by phase, vLLM's timings among them)."""
    port, grpc_port = free_port(), free_port()
    config = MeshConfig(ModelConfig(model),
                        ServeConfig(mode, grpc_port=grpc_port, **serve),
                        HttpConfig(http_port=port),
                        limit=LimitConfig(0), log=LogConfig(log_level),
                        lora=LoraConfig(list(lora_modules)),
                        gateway=gateway or GatewayConfig(),
                        vllm_flags=list(vllm_flags))  # fmt: skip
    mesh = Mesh.forking(plan(config))
    with open(log, "w") as out:
        try:
            mesh.start(timeout=900, log=out)
        except RuntimeError as exc:
            # The stages that did start would hold the machine (a GPU's memory) for the next.
            mesh.stop()
            lines = log.read_text(errors="replace").splitlines()
            print(f"{mode} did not start ({exc}); the end of {log}:", *lines[-15:], sep="\n")
            # Why, for the record: the last exception as Python prints it (and the line after,
            # where pydantic says what it refused).
            raised = [i for i, line in enumerate(lines) if _EXCEPTION.match(line)]
            why = " ".join(x.strip() for x in lines[raised[-1] : raised[-1] + 2]) if raised else ""
            raise RuntimeError(f"{exc}: {why}" if why else str(exc)) from None
    reader = {"e/pd": "worker", "e/p/d": "prefill"}.get(mode, "")
    metrics = mesh.stage(reader).metrics_url if reader else ""
    pids = {stage.name: stage.process.pid for stage in mesh.stages if stage.process}
    return Server(
        mode, f"http://127.0.0.1:{port}", reader_metrics=metrics, stop=[mesh.stop], pids=pids,
        metrics={stage.name: stage.metrics_url for stage in mesh.stages},
        grpc_address=f"127.0.0.1:{grpc_port}",
    )  # fmt: skip
