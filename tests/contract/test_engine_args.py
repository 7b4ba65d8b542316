"""vLLM's engine arguments through Prism: read by vLLM's own parser, every one of them,
except those a worker's role and Prism's own flags decide."""

from __future__ import annotations

import dataclasses
import os

import pytest
from support.meshes import mesh_config

from prism import cli
from prism.config.commands import WorkerStageConfig
from prism.engine import launch
from prism.engine.launch import engine_args, vllm_flags
from prism.media.modalities import per_prompt
from prism.modes import EngineRole
from prism.ops.plan import plan


def test_the_flags_given_and_only_those_are_read_as_vllm_reads_them():
    given = vllm_flags(["--max-num-seqs", "8", "--gpu-memory-utilization=0.5",
                        "--enforce-eager", "-tp", "2", "--no-enable-prefix-caching"])  # fmt: skip
    assert given == {"max_num_seqs": 8, "gpu_memory_utilization": 0.5, "enforce_eager": True,
                     "tensor_parallel_size": 2, "enable_prefix_caching": False}  # fmt: skip
    assert vllm_flags([]) == {}


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--max-num-seqz", "8"], "neither Prism's flags nor vLLM's"),
     (["--max-num-seqs", "many"], "invalid int value"),
     (["--kv-transfer-config", "{}"], "kv_transfer_config: set by Prism"),
     (["--limit-mm-per-prompt", "{}"], "limit_mm_per_prompt: set by Prism")],
)  # fmt: skip
def test_unknown_bad_or_prism_owned_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        vllm_flags(flags)


def test_a_workers_engine_takes_them_over_its_defaults(models):
    args = cli.build_parser().parse_args(
        ["worker", "--model", str(models["llava"]), "--role", "prefill", "--kv-host", "127.0.0.1",
         "--kv-port", "1"]
    )  # fmt: skip
    config = WorkerStageConfig.from_args(
        args, vllm_flags=["--max-num-seqs", "8", "--no-enforce-eager"]
    )
    engine = engine_args(config, per_prompt(config.media))
    assert (engine.max_num_seqs, engine.enforce_eager) == (8, False)
    # Left alone: what the role decides, and eager execution on the CPU backend.
    assert engine.kv_transfer_config.kv_connector == "NixlConnector"
    assert engine.kv_transfer_config.kv_buffer_device == "cpu"
    assert engine.enable_mm_embeds
    config = dataclasses.replace(
        config, vllm_flags=[], worker=dataclasses.replace(config.worker, role=EngineRole.AGGREGATED)
    )
    assert engine_args(config, per_prompt(config.media)).enforce_eager
    assert engine_args(config, per_prompt(config.media)).mm_tensor_ipc == "direct_rpc"


def test_serve_passes_vllm_engine_arguments_to_every_engine():
    args, unknown = cli.build_parser().parse_known_args(
        ["serve", "--model", "m", "--mode", "ep/d", "--max-num-seqs", "8", "-tp", "2"]
    )
    assert unknown == ["--max-num-seqs", "8", "-tp", "2"]
    args.engine_gpus = 1
    assert cli._vllm_flags(cli.build_parser(), args, unknown) == unknown
    assert args.engine_gpus == 2
    config = mesh_config("ep/d", "m", gpus=["none"], vllm_flags=unknown)
    engines = [stage for stage in plan(config) if stage.name.startswith(("prefill", "decode"))]
    for stage in engines:
        start = stage.argv.index("--max-num-seqs")
        assert stage.argv[start : start + 4] == unknown


def test_a_gpu_engine_takes_device_embeddings_with_its_processes_spawned(models, monkeypatch):
    # vLLM refuses the tensor IPC that carries device tensors with forked worker processes.
    monkeypatch.setattr(launch.current_platform, "is_cpu", lambda: False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    args = cli.build_parser().parse_args(
        ["worker", "--model", str(models["llava"]), "--role", "aggregated", "--enable-mm-embeds"]
    )
    config = WorkerStageConfig.from_args(args, vllm_flags=[])
    assert engine_args(config, per_prompt(config.media)).mm_tensor_ipc == "torch_shm"
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert engine_args(config, per_prompt(config.media)).mm_tensor_ipc == "direct_rpc"


def test_a_disaggregated_gpu_engine_reads_device_kv_over_cuda_ipc(models, monkeypatch):
    # UCX leaves CUDA IPC's zero-copy GET off without NVLink; decode READs the KV.
    args = cli.build_parser().parse_args(
        ["worker", "--model", str(models["llava"]), "--role", "decode", "--kv-host", "127.0.0.1",
         "--kv-port", "1"]
    )  # fmt: skip
    config = WorkerStageConfig.from_args(args, vllm_flags=[])
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    engine_args(config, per_prompt(config.media))
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in os.environ  # no CUDA IPC on the CPU
    monkeypatch.setattr(launch.current_platform, "is_cpu", lambda: False)
    engine_args(config, per_prompt(config.media))
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "off")  # a user's value wins
    engine_args(config, per_prompt(config.media))
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "off"
