"""An engine's settings: the worker's, which runs vLLM (or the simulated engine), and the
engine's own that `prism serve` hands every worker."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.flags import Flags, flag
from prism.modes import EngineRole


@dataclass
class EngineConfig(Flags):
    dtype: str = flag("auto", "weights dtype (auto: float32 on CPU, else the model's)",
                      always=True)  # fmt: skip
    kv_cache_gib: int = flag(1, "KV cache size on CPU (GiB)", always=True)
    engine: str = flag(
        "vllm",
        "vllm, or sim: a simulated engine without a model (vLLM-like batching and "
        "prefix cache, timing from the --sim-* flags), for routing, migration and load",
        choices=("vllm", "sim"),
        always=True,
    )
    seed: int = flag(0, "the engines' random seed, as vLLM's --seed")
    stream_interval: int = flag(
        1,
        "tokens per streamed reply after the first, as vLLM's --stream-interval: fewer "
        "messages on every hop to the client, each token held back at most N-1 engine steps",
        metavar="N",
    )


@dataclass
class WorkerConfig(Flags):
    """`prism worker`'s own flags."""

    role: EngineRole = flag(
        EngineRole.AGGREGATED,
        "aggregated: whole answers; prefill (images as embeddings) and encode_prefill "
        "(images as pixels): the prompt's KV cache and first token; decode: the rest",
        always=True,
    )
    enable_mm_embeds: bool = flag(
        False,
        "take precomputed embeddings (an encoder's, read over NIXL, or a client's, inline) "
        "instead of images (implied by --role prefill and decode)",
    )
    kv_host: str = flag(
        "", "address of the KV side channel that decode workers connect to (default: --host)"
    )
    kv_port: int = flag(0, "KV side channel port (default: a free port)")
    kv_lease_s: int = flag(
        30, "prefill roles: free a prompt's KV after this long if no decode reads it"
    )
    pool_mib: int = flag(256, "NIXL read buffer (MiB)")
    engine_nice: int | None = flag(
        None,
        "run the engine's processes this much nicer than the mesh's request path "
        "(default: 10 on the CPU backend, where they share its cores; 0 elsewhere)",
    )
