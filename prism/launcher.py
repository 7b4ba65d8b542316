"""`prism serve`: every stage of a mode as its own OS process on one machine.

The launcher picks free loopback ports, wires the stages together through the static
registry (`--peer ROLE=ADDRESS`), waits until every stage reports healthy, restarts a
stage that exits (prism.supervisor), and on SIGINT/SIGTERM (or when a stage keeps dying)
stops them all. Children also get SIGTERM from the kernel if the launcher itself dies,
so no stage outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from prism import gpus, processes
from prism.config.common import AddressConfig, MetricsConfig
from prism.config.stages import MeshConfig, ProcessorConfig, WorkerConfig
from prism.modes import EngineRole, MeshRole, mode
from prism.ports import free_port
from prism.rpc.channel import check_health
from prism.supervisor import Supervisor

_PR_SET_PDEATHSIG = 1


def prepare_child(cpus: set[int]) -> None:
    """Runs in the child before exec: dies with the launcher, keeps to its cores."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, cpus)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def core_slices(engines: int) -> list[set[int]]:
    """The CPU cores of each engine. On the CPU backend, engines whose OpenMP threads
    share cores run many times slower, and an engine holding KV for a decode polls
    without pause: each engine, with all its processes, stays on its own cores. With
    more engines than cores, the first ones (prefills come first) still get a core of
    their own and the last ones share the last core."""
    cores = sorted(os.sched_getaffinity(0))
    if engines > len(cores):
        return [{cores[min(i, len(cores) - 1)]} for i in range(engines)]
    size = len(cores) // engines
    return [set(cores[i * size : (i + 1) * size]) for i in range(engines)]


@dataclass
class StageProcess:
    """A stage as the launcher runs it: its command line, and where and how it runs."""

    name: str
    address: str
    argv: list[str]
    healthy: Callable[[], bool]
    metrics_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # CPU cores the stage's processes may run on (all when empty).
    cpus: set[int] = field(default_factory=set)
    # The GPUs it runs on (none: the CPU) and, for a vLLM engine, its share of their memory.
    placement: gpus.Placement = field(default_factory=lambda: gpus.Placement(()))
    process: subprocess.Popen | None = None


def _grpc_stage(
    name: str, host: str, argv: list[str], port: int = 0, reach: str = ""
) -> StageProcess:
    """A gRPC stage bound to `host` at `port` (0: a free one); `reach`: the host to reach
    it at where `host` is a wildcard."""
    port = port or free_port(host)
    address = f"{reach or host}:{port}"
    metrics_port = free_port(host)
    return StageProcess(
        name,
        address,
        [*argv, *AddressConfig(host, port).to_argv(),
         *MetricsConfig(metrics_port=metrics_port).to_argv()],
        lambda: check_health(address),
        metrics_url=f"http://{reach or host}:{metrics_port}/metrics",
    )  # fmt: skip


def _gateway_healthy(base_url: str, kserve_address: str) -> bool:
    """/health, and the KServe port's gRPC health where it is served: both doors open."""
    if not http_ok(f"{base_url}/health"):
        return False
    return not kserve_address or check_health(kserve_address, "inference.GRPCInferenceService")


def _place_on_gpus(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> None:
    """Holds each encoder and engine to the GPUs `--gpus` plans for it."""
    units = [
        gpus.Unit(stage.name, role, config.engine_gpus if role != MeshRole.ENCODER else 0)
        for role, stages in by_role.items()
        for stage in stages
    ]
    vllm = config.engine.engine == "vllm"
    available = gpus.parse(config.serve.gpus or ["auto"], set(by_role)) if vllm else []
    placements = gpus.place(units, available)
    if not any(placement.gpus for placement in placements.values()):
        return
    user_fraction = any(flag.startswith("--gpu-memory-utilization") for flag in config.vllm_flags)
    for stage in (stage for stages in by_role.values() for stage in stages):
        stage.placement = placements[stage.name]
        # Cores are the CPU backend's to share out; GPU engines keep all of them.
        stage.cpus = set()
        stage.env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        stage.env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, stage.placement.gpus))
        fraction = stage.placement.memory_fraction
        if fraction is not None and not user_fraction:
            stage.argv += ["--gpu-memory-utilization", str(fraction)]


def _prism(config: MeshConfig) -> list[str]:
    """The command line of a stage up to its command."""
    return [sys.executable, "-m", "prism.cli", *config.log.to_argv()]


def _model(config: MeshConfig) -> list[str]:
    """The flags of every stage that holds the model (all but the gateway)."""
    return [*config.model.to_argv(), *config.media.to_argv(), *config.registry_args,
            *config.tls.to_argv()]  # fmt: skip


def _engines(config: MeshConfig) -> dict[str, list[StageProcess]]:
    """The engines of the mode, by role: aggregated workers, or prefills and decodes."""
    deployed = mode(config.serve.mode)
    host = config.serve.host
    sim = config.sim.to_argv() if config.engine.engine == "sim" else []
    engine = [*_prism(config), "worker", *_model(config), *config.engine.to_argv(), *sim,
              *config.vllm_flags, *config.reasoning.to_argv(),
              *config.transfer.to_argv()]  # fmt: skip

    def workers(name: str, count: int, role: EngineRole, embeds: bool) -> list[StageProcess]:
        # Each disaggregated engine has its own KV side channel.
        kv = deployed.prefill is not None
        return [
            _grpc_stage(f"{name}-{i}", host, [*engine, *WorkerConfig(
                role, enable_mm_embeds=embeds, kv_port=free_port(host) if kv else 0
            ).to_argv()])
            for i in range(count)
        ]  # fmt: skip

    embeds = config.serve.enable_mm_embeds
    if deployed.prefill is None:
        # Behind encoders, the worker takes their embeddings.
        behind = deployed.has_encoder and config.serve.encoders > 0
        aggregated = workers("worker", config.serve.workers, EngineRole.AGGREGATED,
                             embeds or behind)  # fmt: skip
        return {MeshRole.WORKER: aggregated}
    return {
        MeshRole.PREFILL: workers(
            "prefill", config.serve.prefill_workers, deployed.prefill, embeds
        ),
        MeshRole.DECODE: workers("decode", config.serve.decode_workers, EngineRole.DECODE, False),
    }


def plan(config: MeshConfig) -> list[StageProcess]:
    """The stages of a mode, in start order, with their ports and peers."""
    deployed = mode(config.serve.mode)
    host = config.serve.host
    encoders = [
        _grpc_stage(f"encoder-{i}", host, [*_prism(config), "encoder", *_model(config),
                                           *config.transfer.to_argv(), *config.fetch.to_argv()])
        for i in range(config.serve.encoders if deployed.has_encoder else 0)
    ]  # fmt: skip
    by_role = _engines(config)
    engines = [stage for stages in by_role.values() for stage in stages]
    # One engine alone keeps vLLM's own binding; simulated ones compute nothing.
    vllm = config.engine.engine == "vllm"
    if vllm and len(engines) > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        for stage, cores in zip(engines, core_slices(len(engines)), strict=True):
            stage.cpus = cores
            stage.env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(cores)))
    by_role[MeshRole.ENCODER] = encoders
    _place_on_gpus(config, by_role)
    processor = _processor(config, by_role)
    stages = [*encoders, *engines, processor, _gateway(config, processor)]
    for stage in stages:
        # vLLM has its own logger; keep it as quiet as the stages were asked to be.
        stage.env.setdefault(
            "VLLM_LOGGING_LEVEL",
            os.environ.get("VLLM_LOGGING_LEVEL", config.log.log_level.upper()),
        )
    return stages


def _peers(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> list[str]:
    """The static registry's entries for `by_role`: a dynamic registry tells each stage
    where its peers are."""
    if config.registry_args:
        return []
    return [arg for role, stages in by_role.items() for s in stages
            for arg in ("--peer", f"{role}={s.address}")]  # fmt: skip


def _processor(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> StageProcess:
    grpc_host = config.serve.grpc_host or config.serve.host
    own = ProcessorConfig(config.serve.mode, enable_mm_embeds=config.serve.enable_mm_embeds)
    return _grpc_stage(
        "processor",
        grpc_host,
        [*_prism(config), "processor", *_model(config), *config.fetch.to_argv(), *own.to_argv(),
         *config.routing.to_argv(), *config.limit.to_argv(), *config.tools.to_argv(),
         *config.reasoning.to_argv(), *_peers(config, by_role)],
        port=config.serve.grpc_port,
        reach=config.serve.host if _is_wildcard(grpc_host) else "",
    )  # fmt: skip


def _gateway(config: MeshConfig, processor: StageProcess) -> StageProcess:
    host, kserve_port = config.serve.host, config.gateway.kserve_grpc_port
    base_url = f"http://{host}:{config.serve.http_port}"
    kserve_address = f"{host}:{kserve_port}" if kserve_port else ""
    return StageProcess(
        "gateway",
        base_url,
        [*_prism(config), "gateway", *AddressConfig(host, config.serve.http_port).to_argv(),
         *config.gateway.to_argv(), *config.limit.to_argv(), *config.registry_args,
         *config.tls.to_argv(), *_peers(config, {"processor": [processor]})],
        functools.partial(_gateway_healthy, base_url, kserve_address),
        metrics_url=f"{base_url}/metrics",
        # In the environment rather than the command line, where `ps` would show it.
        env={"PRISM_API_KEY": config.gateway.api_key},
    )  # fmt: skip


class Mesh:
    """Starts and stops a planned set of stages."""

    def __init__(self, stages: list[StageProcess]):
        self.stages = stages

    def stage(self, name: str) -> StageProcess:
        """The stage called `name`, or the first `name-N` replica."""
        return next(s for s in self.stages if s.name in (name, f"{name}-0"))

    def address(self, name: str) -> str:
        return self.stage(name).address

    def start(self, timeout: float = 300.0, log: IO | None = None) -> None:
        """Starts every stage (output to `log` if given) and waits until all are healthy."""
        for stage in self.stages:
            self.spawn(stage, log)
        self._wait_healthy(list(self.stages), timeout)

    def restart(
        self, name: str, argv: list[str] | None = None, timeout: float = 300.0,
        log: IO | None = None,
    ) -> None:  # fmt: skip
        """Stops the stage `name` and starts it again, with `argv` in place of its own if
        given, at the same address; waits until it is healthy."""
        stage = self.stage(name)
        if stage.process is not None:
            processes.stop(stage.process, grace=15)
        if argv is not None:
            stage.argv = argv
        self.spawn(stage, log)
        self._wait_healthy([stage], timeout)

    def spawn(self, stage: StageProcess, log: IO | None = None) -> None:
        stage.process = subprocess.Popen(
            stage.argv,
            env={**os.environ, **stage.env},
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            # Its own process group, so that stop() also reaches the processes a stage
            # spawned (vLLM's engine core) even when the stage itself died abruptly.
            # Not its own session: the kernel shares CPU equally between sessions
            # (autogroups), whatever their niceness, and the engine is to run nicer
            # than every stage that feeds it.
            process_group=0,
            preexec_fn=functools.partial(prepare_child, stage.cpus),
        )

    def _wait_healthy(self, pending: list[StageProcess], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while pending:
            self.check_alive()
            pending = [stage for stage in pending if not stage.healthy()]
            if pending and time.monotonic() > deadline:
                names = ", ".join(stage.name for stage in pending)
                raise TimeoutError(f"stages not healthy after {timeout:.0f}s: {names}")
            if pending:
                time.sleep(0.5)

    def check_alive(self) -> None:
        """Raises if a stage has exited."""
        for stage in self.stages:
            if stage.process is not None and (code := stage.process.poll()) is not None:
                raise RuntimeError(f"{stage.name} exited ({processes.exit_reason(code)})")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to every stage, front first, so that no new work reaches the stages
        behind it; after `grace` seconds, SIGKILL. A stage that still does not go is
        reported and left (prism.processes)."""
        running = [s.process for s in reversed(self.stages) if s.process is not None]
        for process in running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in running:
            processes.finish(process, grace=max(0.1, deadline - time.monotonic()))


class _StopRequested(Exception):
    pass


def _raise_stop(signum: int, frame: object) -> None:
    raise _StopRequested


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name


def endpoints(config: MeshConfig, mesh: Mesh) -> dict:
    """Where a running mesh answers: its public APIs, and each stage."""
    host, kserve_port = config.serve.host, config.gateway.kserve_grpc_port
    return {
        "mode": config.serve.mode,
        "model": config.model.served_model_name or config.model.model,
        "openai": f"http://{host}:{config.serve.http_port}/v1",
        "grpc": mesh.address("processor"),
        "kserve_grpc": f"{host}:{kserve_port}" if kserve_port else None,
        "pid": os.getpid(),
        "stages": [
            {"name": stage.name, "role": stage.name.rpartition("-")[0] or stage.name,
             "address": stage.address, "metrics": stage.metrics_url,
             "gpus": list(stage.placement.gpus),
             "gpu_memory_fraction": stage.placement.memory_fraction}
            for stage in mesh.stages
        ],
    }  # fmt: skip


def describe(status: dict) -> str:
    """`endpoints` as `prism serve` prints them once ready."""
    lines = [
        f"prism ({status['mode']}) ready: {status['openai']}",
        f"  OpenAI API  {status['openai']}",
        f"  gRPC        {status['grpc']}  (prism.v1.InferenceService)",
    ]
    if status["kserve_grpc"]:
        lines.append(f"  KServe v2   {status['kserve_grpc']}  (inference.GRPCInferenceService)")
    lines.append("  stages:")
    width = max(len(stage["name"]) for stage in status["stages"])
    lines += [
        f"    {s['name']:<{width}}  {s['role']:<9}  {s['address']}  metrics {s['metrics']}"
        for s in status["stages"]
    ]
    return "\n".join(lines)


def _write_status(path: str, status: dict) -> None:
    """Whole or not at all: a script polling for the file never reads half of it."""
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        json.dump(status, out, indent=2)
    os.replace(partial, path)


def _say(line: str) -> None:
    print(f"prism: {line}", file=sys.stderr, flush=True)


def run(config: MeshConfig) -> int:
    """Runs the mesh in the foreground until a signal, restarting the stages that exit
    (prism.supervisor) until one exits too often; once it is ready, prints its
    endpoints (and writes them to `--status-file` as JSON, if given)."""

    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    mesh = Mesh(plan(config))
    placed = [stage for stage in mesh.stages if stage.placement.gpus]
    if placed:
        print("prism: GPU plan", flush=True)
        for stage in placed:
            print(f"  {gpus.describe(stage.name, stage.placement)}", flush=True)
    written = False
    try:
        mesh.start()
        status = endpoints(config, mesh)
        if config.serve.status_file:
            _write_status(config.serve.status_file, status)
            written = True
        print(describe(status), flush=True)
        supervisor = Supervisor(mesh, mesh.stages, report=_say)
        while True:
            supervisor.poll()
            time.sleep(0.5)
    except _StopRequested:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"prism: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        # Signals during the shutdown itself must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if written:
            # A file left behind would name endpoints that are gone.
            with contextlib.suppress(FileNotFoundError):
                os.remove(config.serve.status_file)
        mesh.stop()
