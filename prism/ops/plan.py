"""Which stages a mode has and how each is started: their command lines, ports, peers,
cores and GPUs, from one MeshConfig. `prism serve` runs the plan (prism.ops.launcher);
`prism deploy kubernetes` writes it out as manifests (prism.ops.deploy).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import sys

from prism.config.common import AddressConfig, MetricsConfig
from prism.config.stages import HttpConfig, MeshConfig, ProcessorConfig, WorkerConfig
from prism.modes import EngineRole, MeshRole, mode
from prism.ops import gpus
from prism.ops.stage_process import StageProcess, core_slices, http_ok
from prism.registry.config import STATIC
from prism.rpc.channel import check_health
from prism.runtime.ports import free_port


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
    return [*config.model.to_argv(), *config.media.to_argv(), *config.registry.to_argv(),
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
    stages = [*encoders, *engines, *_front(config, by_role)]
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
    if config.registry.registry != STATIC:
        return []
    return [arg for role, stages in by_role.items() for s in stages
            for arg in ("--peer", f"{role}={s.address}")]  # fmt: skip


def _front(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> list[StageProcess]:
    """The processor and the OpenAI REST API (and KServe): one process (`--front
    combined`), or a processor and a gateway calling it over gRPC."""
    grpc_host = config.serve.grpc_host or config.serve.host
    own = ProcessorConfig(config.serve.mode, enable_mm_embeds=config.serve.enable_mm_embeds)
    argv = [*_model(config), *config.fetch.to_argv(), *own.to_argv(), *config.routing.to_argv(),
            *config.limit.to_argv(), *config.tools.to_argv(), *config.reasoning.to_argv(),
            *_peers(config, by_role)]  # fmt: skip
    reach = config.serve.host if _is_wildcard(grpc_host) else ""
    http = HttpConfig(config.http.http_host or config.serve.host, config.http.http_port)
    base_url = f"http://{http.http_host}:{http.http_port}"
    kserve_port = config.gateway.kserve_grpc_port
    http_healthy = functools.partial(
        _gateway_healthy, base_url, f"{http.http_host}:{kserve_port}" if kserve_port else ""
    )
    # In the environment rather than the command line, where `ps` would show it.
    env = {"PRISM_API_KEY": config.gateway.api_key}
    if config.serve.front == "combined":
        front = _grpc_stage("front", grpc_host, [*_prism(config), "front", *argv,
                                                 *http.to_argv(), *config.gateway.to_argv()],
                            port=config.serve.grpc_port, reach=reach)  # fmt: skip
        grpc_healthy = front.healthy
        front.healthy = lambda: grpc_healthy() and http_healthy()
        front.url = base_url
        front.env.update(env)
        return [front]
    processor = _grpc_stage("processor", grpc_host, [*_prism(config), "processor", *argv],
                            port=config.serve.grpc_port, reach=reach)  # fmt: skip
    gateway = StageProcess(
        "gateway",
        base_url,
        [*_prism(config), "gateway", *AddressConfig(http.http_host, http.http_port).to_argv(),
         *config.gateway.to_argv(), *config.limit.to_argv(), *config.registry.to_argv(),
         *config.tls.to_argv(), *_peers(config, {"processor": [processor]})],
        http_healthy,
        metrics_url=f"{base_url}/metrics",
        url=base_url,
        env=env,
    )  # fmt: skip
    return [processor, gateway]


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name
