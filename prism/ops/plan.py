"""Which stages a mode has and how each is started: their command lines, ports, peers,
cores and GPUs, from one MeshConfig. `prism serve` runs the plan (prism.ops.launcher);
`prism deploy kubernetes` writes it out as manifests (prism.ops.deploy).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

from prism.config.commands import MeshConfig, ServeConfig
from prism.config.engine import WorkerConfig
from prism.config.registry import STATIC
from prism.modes import EngineRole, MeshRole, mode
from prism.ops import fronts, gpus
from prism.ops.stage_process import StageProcess, core_slices, grpc_stage
from prism.runtime.ports import free_port


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
    user_fraction = _given(config, "--gpu-memory-utilization")
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
    simulated = config.engine.engine == "sim"
    engine = [*_prism(config), "worker", *_model(config), *config.engine.to_argv(),
              *config.vllm_flags, *config.reasoning.to_argv(),
              *config.transfer.to_argv()]  # fmt: skip
    # Simulated engines go --sim-engines to a process, each its own replica.
    per_process = config.sim.sim_engines if simulated else 1

    def workers(name: str, count: int, role: EngineRole, embeds: bool) -> list[StageProcess]:
        # Each disaggregated engine has its own KV side channel.
        kv = deployed.prefill is not None
        stages = []
        for i, first in enumerate(range(0, count, per_process)):
            servers = min(per_process, count - first)
            sim = dataclasses.replace(config.sim, sim_engines=servers) if simulated else None
            argv = [*engine, *(sim.to_argv() if sim else []), *WorkerConfig(
                role, enable_mm_embeds=embeds, kv_port=free_port(host) if kv else 0
            ).to_argv()]  # fmt: skip
            stages.append(grpc_stage(f"{name}-{i}", host, argv, servers=servers))
        return stages

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


def check_model(model: str) -> None:
    """Refuses a model directory that is missing or holds no config.json once, before any
    stage starts (each would fail on its own, a traceback each). A name that is no local
    path (ORG/NAME, where no ORG directory is here) is a hub id, the stages' to fetch."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: the directory holds no config.json")
        return
    explicit = path.is_absolute() or model.startswith((".", "~"))
    in_a_local_directory = str(path.parent) != "." and path.parent.is_dir()
    if path.exists() or explicit or in_a_local_directory:
        raise ValueError(f"--model {model}: no such model directory")


def check_lora(config: MeshConfig) -> None:
    """Refuses malformed `--lora-modules`, and adapters without the engines' LoRA (as
    `vllm serve --lora-modules` needs `--enable-lora`), before any stage starts."""
    if config.lora.modules() and "--enable-lora" not in config.vllm_flags:
        raise ValueError("--lora-modules needs --enable-lora (vLLM's engines serve adapters)")


def _refuse_unused_counts(config: MeshConfig) -> None:
    """A replica count the mode has no role for is refused, not ignored (`--mode epd
    --prefill 3` would start one aggregated worker)."""
    deployed = mode(config.serve.mode)
    split = deployed.prefill is not None
    applies = {"encoders": deployed.has_encoder, "workers": not split,
               "prefill_workers": split, "decode_workers": split}  # fmt: skip
    default = ServeConfig()
    for name, used in applies.items():
        if not used and getattr(config.serve, name) != getattr(default, name):
            raise ValueError(f"--{name.replace('_', '-')} does not apply to --mode {deployed}")


def plan(config: MeshConfig) -> list[StageProcess]:
    """The stages of a mode, in start order, with their ports and peers."""
    _refuse_unused_counts(config)
    deployed = mode(config.serve.mode)
    host = config.serve.host
    encoders = [
        grpc_stage(f"encoder-{i}", host, [*_prism(config), "encoder", *_model(config),
                                           *config.transfer.to_argv(), *config.fetch.to_argv(),
                                           *config.sim_encoder.to_argv()])
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
    front = fronts.plan(config, _prism(config), _model, functools.partial(_peers, config), by_role)
    stages = [*encoders, *engines, *front]
    if config.registry.consul_token:
        # In the environment rather than the command line, where `ps` would show it.
        for stage in stages:
            stage.env["CONSUL_HTTP_TOKEN"] = config.registry.consul_token
    _logging(config, stages)
    _start_order(config, [*encoders, *engines], engines)
    if config.serve.compile_cache:
        cache = os.path.abspath(config.serve.compile_cache)
        for stage in engines:
            stage.env.update(VLLM_CACHE_ROOT=os.path.join(cache, "vllm"),
                             TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                             TRITON_CACHE_DIR=os.path.join(cache, "triton"))  # fmt: skip
    return stages


def _logging(config: MeshConfig, stages: list[StageProcess]) -> None:
    """vLLM has its own logger. It logs at INFO at least, which is where it says what it is
    doing while it starts (prism.ops.phases); the launcher shows its lines from the
    stages' level up, or from the level the user set for it."""
    level = config.log.log_level.upper()
    vllm_level = os.environ.get("VLLM_LOGGING_LEVEL", "DEBUG" if level == "DEBUG" else "INFO")
    for stage in stages:
        stage.env.setdefault("VLLM_LOGGING_LEVEL", vllm_level)
        stage.log_level = os.environ.get("VLLM_LOGGING_LEVEL", level)
        stage.tag_lines = config.log.log_format != "json"


def _start_order(
    config: MeshConfig, placed: list[StageProcess], engines: list[StageProcess]
) -> None:
    """Which engines wait for other stages to serve before they start their engine (they
    import meanwhile; prism.ops.launcher).

    An engine on a GPU waits for the stages placed on it before: vLLM sizes an engine's KV
    cache from the memory its profiling run sees used on the device, and a stage loading
    beside it meanwhile would be counted as its own. Not where the KV cache is given in
    bytes (vLLM's `--kv-cache-memory-bytes`, which skips that sizing): there they start
    together. On the CPU, engines that compile (vLLM's `--no-enforce-eager`; Prism's CPU
    engines run eagerly otherwise) wait for the first, whose compiled graphs they then load
    from the cache they share."""
    profiled = not _given(config, "--kv-cache-memory-bytes")
    last_on: dict[int, str] = {}
    for stage in placed:
        if stage in engines and profiled:
            stage.after = sorted({last_on[g] for g in stage.placement.gpus if g in last_on})
        last_on.update(dict.fromkeys(stage.placement.gpus, stage.name))
    compiled = config.engine.engine == "vllm" and "--no-enforce-eager" in config.vllm_flags
    if compiled and not any(stage.placement.gpus for stage in engines):
        for stage in engines[1:]:
            stage.after = [engines[0].name]


def _given(config: MeshConfig, flag: str) -> bool:
    """Whether the user gave vLLM `flag` (alone or as `flag=value`)."""
    return any(given.startswith(flag) for given in config.vllm_flags)


def _peers(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> list[str]:
    """The static registry's entries for `by_role`: a dynamic registry tells each stage
    where its peers are."""
    if config.registry.registry != STATIC:
        return []
    return [arg for role, stages in by_role.items() for s in stages
            for address in s.replicas for arg in ("--peer", f"{role}={address}")]  # fmt: skip
