"""A worker's vLLM engine: its environment and arguments from the worker's flags and the
vLLM flags it passes through, the `AsyncLLM` that runs it, and its priority beside the
request path."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from vllm import AsyncEngineArgs
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.platforms import current_platform
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.ompmultiprocessing import OMPProcessManager
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.executor import Executor

from prism import registry
from prism.engine.core_process import forked_core
from prism.modes import EngineRole
from prism.runtime import processes
from prism.runtime.ports import free_port
from prism.transfer.nixl_agent import read_device_memory_by_ipc

if TYPE_CHECKING:
    from prism.config.commands import WorkerStageConfig

log = logging.getLogger(__name__)

# Roles that take images as embeddings: `prefill` reads them from the encoder; `decode`
# gets placeholders, since the images' KV comes from prefill.
_EMBEDS_ROLES = (EngineRole.PREFILL, EngineRole.DECODE)
_MULTIPROC_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"

# Engine arguments that the worker's role and its own flags decide; a vLLM flag that set
# them would break the role's contract with the mesh.
_OWNED = frozenset({
    "model", "served_model_name", "dtype", "max_model_len", "seed", "enable_mm_embeds",
    "limit_mm_per_prompt", "kv_transfer_config", "kv_events_config", "worker_extension_cls",
    "reasoning_parser", "enable_log_requests", "disable_log_stats",
})  # fmt: skip


def vllm_flags(flags: list[str]) -> dict[str, object]:
    """The engine arguments that `flags` (as `vllm serve` takes them) set, by field name.

    vLLM's own parser reads them, so every engine argument of the installed vLLM is taken,
    with its own checks and help; an unknown flag, or one that Prism sets itself, is an
    error."""
    parser = AsyncEngineArgs.add_cli_args(
        FlexibleArgumentParser(prog="vLLM engine arguments", exit_on_error=False)
    )
    # Only what is given: argparse leaves what a namespace already has, unless a flag sets it.
    unset = object()
    blank = argparse.Namespace(**dict.fromkeys(vars(parser.parse_args([])), unset))
    try:
        parsed, unknown = parser.parse_known_args(flags, namespace=blank)
    except argparse.ArgumentError as exc:
        raise ValueError(str(exc)) from None
    if unknown:
        raise ValueError(f"neither Prism's flags nor vLLM's engine arguments: {' '.join(unknown)}")
    given = {name: value for name, value in vars(parsed).items() if value is not unset}
    owned = sorted(_OWNED & given.keys())
    if owned:
        raise ValueError(
            f"{', '.join(owned)}: set by Prism from the worker's own flags and role, not "
            "from vLLM flags (use --model, --dtype, --max-model-len, --seed, --max-images ...)"
        )
    return given


def start_engine(
    config: WorkerStageConfig,
    sockets: Path,
    media_limits: dict[str, int],
    kv_events: KVEventsConfig | None = None,
) -> AsyncLLM:
    """The worker's engine, started, at the priority `--engine-nice` gives it, with its
    local sockets in `sockets` (the worker's own directory), taking at most `media_limits`
    items of each modality (by name) per request, publishing its KV events as `kv_events`
    says."""
    processes.wait_for_turn()
    _configure(config, sockets)
    engine = _async_llm(engine_args(config, media_limits, kv_events))
    niceness = config.worker.engine_nice
    if niceness is None:
        niceness = 10 if current_platform.is_cpu() else 0
    if niceness:
        threads = _lower_engine_priority(niceness)
        log.info("engine: %d threads made %d nicer than the request path", threads, niceness)
    return engine


# vLLM's loggers that announce each engine core it kills when its teardown time is up.
_KILL_LOGGERS = ("vllm.v1.utils", "vllm.utils.system_utils")


def stop_engine(engine: AsyncLLM) -> None:
    """Stops the engine of a worker that has drained. On the CPU its core is not given
    time to tear itself down: what it holds (memory, sockets) its exit frees, and vLLM's
    teardown (a full garbage collection of the whole unfrozen heap, its process groups)
    serves engines deleted inside a process that goes on; it takes the core about 5 s."""
    if not current_platform.is_cpu():
        engine.shutdown()
        return
    # The kill is the plan here, not a fault to warn an operator about.
    loggers = [logging.getLogger(name) for name in _KILL_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        engine.shutdown(timeout=0)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _configure(config: WorkerStageConfig, sockets: Path) -> None:
    """What vLLM reads from the environment when the engine starts: the KV cache size on
    the CPU, where its IPC sockets go, and the NIXL side channel of a disaggregated role."""
    worker = config.worker
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.engine.kv_cache_gib)
    # vLLM leaves its sockets in the temporary directory; in the worker's, they go with it.
    os.environ["VLLM_RPC_BASE_PATH"] = str(sockets)
    if current_platform.is_cpu():
        # vLLM's CPU backend compiles with Inductor directly, and vLLM 0.32 cannot load the
        # AOT artifact it then saves (it calls `finalize_loading`, which only its own
        # backend's functions have): every start would compile again. Without AOT,
        # Inductor's own cache (TORCHINDUCTOR_CACHE_DIR) serves the next start.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if worker.role != EngineRole.AGGREGATED:
        host = worker.kv_host or registry.advertise_host(config.registry, config.address.host)
        port = worker.kv_port or free_port(host)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
        log.info("worker (%s) KV side channel on %s:%d", worker.role, host, port)


def engine_args(
    config: WorkerStageConfig,
    media_limits: dict[str, int],
    kv_events: KVEventsConfig | None = None,
) -> AsyncEngineArgs:
    """vLLM's engine arguments: those the worker's flags and role decide, then its vLLM
    flags."""
    worker, model = config.worker, config.model
    disaggregated = worker.role != EngineRole.AGGREGATED
    kv_config = (
        KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"kv_lease_duration": worker.kv_lease_s},
            # The KV that decode reads stays in the memory it was computed in.
            kv_buffer_device=current_platform.device_type,
        )
        if disaggregated
        else None
    )
    if disaggregated and not current_platform.is_cpu():
        # Decode READs the prefill's KV from device memory, as a worker reads embeddings.
        read_device_memory_by_ipc()
    embeds = worker.enable_mm_embeds or worker.role in _EMBEDS_ROLES
    dtype = config.engine.dtype
    # bfloat16 kernels crash (SIGILL) on some CPUs; float32 works everywhere.
    if dtype == "auto" and current_platform.is_cpu():
        dtype = "float32"
    engine = AsyncEngineArgs(
        enable_mm_embeds=embeds,
        kv_transfer_config=kv_config,
        kv_events_config=kv_events,
        worker_extension_cls="prism.engine.extension.EngineExtension",
        model=model.model,
        served_model_name=model.served_model_name or None,
        dtype=dtype,
        max_model_len=model.max_model_len or None,
        limit_mm_per_prompt=media_limits,
        # CUDA graphs where there is a GPU; the CPU backend runs eagerly.
        enforce_eager=current_platform.is_cpu(),
        enable_log_requests=False,
        disable_log_stats=False,
        seed=config.engine.seed,
        stream_interval=config.engine.stream_interval,
        # Structured output (a forced tool call) then starts where reasoning ends.
        reasoning_parser=config.reasoning.reasoning_parser,
    )
    given = vllm_flags(config.vllm_flags)
    engine = dataclasses.replace(engine, **given)
    if embeds and "mm_tensor_ipc" not in given and device_embeddings(engine):
        # Embeddings read into GPU memory reach the engine core as device tensors.
        engine.mm_tensor_ipc = "torch_shm"
    if engine.mm_tensor_ipc == "torch_shm":
        # vLLM refuses that IPC unless its worker processes are spawned, not forked.
        os.environ.setdefault(_MULTIPROC_METHOD, "spawn")
    return engine


def device_embeddings(engine: AsyncEngineArgs) -> bool:
    """Whether embeddings are handed to this engine in device memory: on a GPU, where one
    process runs the model (vLLM's shared-memory tensor IPC, which carries device tensors,
    takes no more)."""
    ranks = engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size
    # A user's forked worker processes keep the host path: vLLM refuses the IPC with them.
    spawned = os.environ.get(_MULTIPROC_METHOD, "spawn") == "spawn"
    return not current_platform.is_cpu() and ranks == 1 and spawned


def embeddings_device(engine: AsyncLLM) -> str:
    """Where the worker reads embeddings into: the GPU where the engine takes device
    tensors (`device_embeddings`), else host memory."""
    multimodal = engine.vllm_config.model_config.multimodal_config
    if multimodal is not None and multimodal.mm_tensor_ipc == "torch_shm":
        return current_platform.device_type
    return "cpu"


def config_info(engine: AsyncLLM) -> dict[str, str]:
    """What the running engine was built with, as vLLM holds it: the settings users set
    with vLLM's flags and ask about first."""
    config = engine.vllm_config
    return {
        "device": str(config.device_config.device_type),
        "dtype": str(config.model_config.dtype).removeprefix("torch."),
        "enforce_eager": str(config.model_config.enforce_eager),
        "max_num_seqs": str(config.scheduler_config.max_num_seqs),
        "max_num_batched_tokens": str(config.scheduler_config.max_num_batched_tokens),
        "max_model_len": str(config.model_config.max_model_len),
        "gpu_memory_utilization": str(config.cache_config.gpu_memory_utilization),
        "tensor_parallel_size": str(config.parallel_config.tensor_parallel_size),
        "enable_prefix_caching": str(config.cache_config.enable_prefix_caching),
        "quantization": str(config.model_config.quantization),
        "kv_cache_dtype": str(config.cache_config.cache_dtype),
        "embeddings_device": embeddings_device(engine),
    }


def _async_llm(args: AsyncEngineArgs) -> AsyncLLM:
    """vLLM's `AsyncLLM`; on the CPU backend, with the model run inside the engine core.

    There vLLM would run the model in a process of its own, and the engine core and that
    process wait for each other's every step by spinning on shared memory: two cores'
    worth of waiting, taken from the request path. Run in one process, the step is a call.
    vLLM's CPU platform allows that only where its multiprocessing flag is off (the flag
    governs nothing else that `AsyncLLM` does)."""
    if not current_platform.is_cpu():
        return AsyncLLM.from_engine_args(args)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args.distributed_executor_backend = "uni"
    config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    # vLLM's own binding (`auto`) keeps a core free for its scheduler process. Here that
    # process runs the model, and shares every core with the request path: bound, the model
    # would wait for a core that the request path holds while another sits idle. So as many
    # OpenMP threads as vLLM would bind, unbound (`forked_core`).
    with forked_core(OMPProcessManager(config)):
        return AsyncLLM(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_requests=args.enable_log_requests,
            log_stats=not args.disable_log_stats,
        )


def _lower_engine_priority(niceness: int) -> int:
    """Makes every thread of this process's children (vLLM's engine core) `niceness`
    nicer; returns how many threads it changed.

    On the CPU backend the engine steps without pause while it has requests, on the same
    cores as the stages that feed it. At equal priority it takes the cores from their gRPC
    and input processing: requests then reach it late and its batches shrink. Nicer, it
    still gets every cycle the request path leaves."""
    changed = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for thread in child.threads():
                with contextlib.suppress(OSError):
                    now = os.getpriority(os.PRIO_PROCESS, thread.id)
                    os.setpriority(os.PRIO_PROCESS, thread.id, now + niceness)
                    changed += 1
    return changed
