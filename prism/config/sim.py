"""The simulated engine's settings (prism.services.sim.engine), and the flags that
set them and a simulated encoder's time (--engine sim; benchmarks of routing and planning)."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.flags import Flags, flag


@dataclass(frozen=True)
class SimConfig:
    """What the simulated engine runs with (prism.services.sim.engine)."""

    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.005
    block_size: int = 16
    num_blocks: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    stream_interval: int = 1


_SIM = SimConfig()


@dataclass
class SimEngineConfig(Flags):
    """The simulated engine's timing and sizes (prism.services.sim.engine)."""

    group = "simulated engine (--engine sim)"

    sim_prefill_tokens_per_s: float = flag(_SIM.prefill_tokens_per_s,
                                           "prompt tokens computed a second")  # fmt: skip
    sim_decode_step_ms: float = flag(_SIM.decode_step_s * 1000,
                                     "time of each step, besides its prompt tokens")  # fmt: skip
    sim_block_size: int = flag(_SIM.block_size, "tokens per KV block")
    sim_kv_blocks: int = flag(_SIM.num_blocks, "KV cache size in blocks")
    sim_max_num_seqs: int = flag(_SIM.max_num_seqs, "sequences a step may hold")
    sim_max_num_batched_tokens: int = flag(_SIM.max_num_batched_tokens,
                                           "tokens a step may compute")  # fmt: skip
    sim_media_tokens: int = flag(16, "prompt tokens an image or video file takes")
    sim_kv_tokens_per_s: float = flag(
        1_000_000.0, "decode: prompt tokens of KV read from prefill a second"
    )
    sim_engines: int = flag(
        1,
        "simulated engines one worker process runs, as Dynamo's mocker does: each its "
        "own replica (own gRPC server at --port + i, KV events, registration)",
        minimum=1,
    )


@dataclass
class SimEncoderConfig(Flags):
    """A larger vision tower's time, simulated on the encoder (benchmarks of planning)."""

    group = "simulated engine (--engine sim)"

    sim_encode_ms: float = flag(
        0.0,
        "encoders: each item's forward pass takes this much longer, as on a larger vision "
        "tower (its device held meanwhile); the embeddings are still the model's",
    )
