"""The configs of one stage each (worker, encoder, processor, gateway), and `prism serve`'s:
its own flags, and `MeshConfig`, everything it takes, which the launcher hands out to the
stages it starts. A stage command takes the whole config of its stage (`...StageConfig`),
whose flags are those of the configs it lists, in their order."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from prism.config.common import (
    AddressConfig,
    FetchConfig,
    LimitConfig,
    LogConfig,
    MediaConfig,
    MetricsConfig,
    ModelConfig,
    ReasoningConfig,
    RoutingConfig,
    TlsConfig,
    ToolsConfig,
    TransferConfig,
)
from prism.config.flags import Flags, flag, nested
from prism.config.planner import PlannerConfig
from prism.gateway.openai.responses import store as responses
from prism.modes import MODES, EngineRole
from prism.registry.config import ConnectConfig, PeersConfig, RegistryConfig
from prism.services.worker.sim_engine import SimConfig

_SIM = SimConfig()


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
    stream_interval: int = flag(
        1,
        "tokens per streamed reply after the first, as vLLM's --stream-interval: fewer "
        "messages on every hop to the client, each token held back at most N-1 engine steps",
        metavar="N",
    )


@dataclass
class SimEngineConfig(Flags):
    """The simulated engine's timing and sizes (prism.services.worker.sim_engine)."""

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


@dataclass
class WorkerConfig(Flags):
    """`prism worker`'s own flags."""

    role: EngineRole = flag(
        EngineRole.AGGREGATED,
        "aggregated: whole answers; prefill (images as embeddings) and encode_prefill "
        "(images as pixels): the prompt's KV cache and first token; decode: the rest",
        always=True,
    )
    seed: int = flag(0)
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


@dataclass
class EncoderConfig(Flags):
    """`prism encoder`'s own flags."""

    pool_mib: int = flag(256, "NIXL embedding pool (MiB)")
    cache_mib: int = flag(256, "embedding cache (MiB)")
    device: str = flag(
        "auto",
        "where the vision path runs and its embeddings are published: cpu, cuda, "
        "cuda:N (auto: the accelerator when there is one)",
    )
    dtype: str = flag(
        "auto",
        "the vision path's dtype (auto: float32 on CPU, as the CPU engine; else the "
        "checkpoint's 16-bit dtype)",
    )
    batch_size: int = flag(
        32, "most items (images, or videos) of concurrent requests encoded in one pass"
    )
    batch_wait_ms: float = flag(2.0, "how long an item waits for others to share its forward pass")
    lease_s: float = flag(30.0, "free unread embeddings after this long")


@dataclass
class ProcessorConfig(Flags):
    """`prism processor`'s own flags."""

    mode: str = flag("epd", choices=MODES, always=True)
    enable_mm_embeds: bool = flag(False, "take image embeddings from clients (image_embeds parts)")
    migration_limit: int = flag(
        1, "times a request moves to another worker replica when the one streaming it dies"
    )
    no_encoder_fallback: bool = flag(
        False,
        "fail a request whose images or videos no encoder can take (none serving, all "
        "full, the encode failed) rather than have the worker encode them from the pixels",
    )


@dataclass
class GatewayConfig(Flags):
    api_key: str = flag(
        help="require 'Authorization: Bearer KEY' on /v1 (default: PRISM_API_KEY; none if unset)",
        factory=lambda: os.environ.get("PRISM_API_KEY", ""),
        secret=True,
    )
    request_timeout: float = flag(
        0, "seconds a generation may take before it ends with 504 (0: no limit)", always=True
    )
    http_keep_alive_s: float = flag(
        75.0,
        "seconds an idle HTTP connection stays open: longer than the idle timeouts of "
        "clients and load balancers (aiohttp 15 s, AWS ALB 60 s), so that they close first "
        "and no request is sent on a connection the server is closing",
        metavar="S",
    )
    kserve_grpc_port: int = flag(
        0,
        "also serve KServe v2 gRPC (inference.GRPCInferenceService, as Triton with its "
        "vLLM backend) on this port (0: not served)",
    )
    responses_store_size: int = flag(
        responses.MAX_ENTRIES,
        "responses the Responses API keeps for previous_response_id and GET (the oldest "
        "goes first; 0: none kept)",
    )
    responses_store_mb: float = flag(
        responses.MAX_MB,
        "megabytes the stored responses take at most, their images' data URLs included (the "
        "oldest go first; a response larger than all is not kept)",
        metavar="MB",
    )
    responses_ttl_s: float = flag(responses.TTL_S, "seconds a stored response is kept", metavar="S")
    responses_store: str = flag(
        "",
        "a SQLite file for the stored responses, which fronts that share it all find "
        "(default: this process's memory; prism serve --front-workers N gives its fronts one)",
        metavar="PATH",
    )


@dataclass
class HttpConfig(Flags):
    """Where a front's OpenAI REST API answers."""

    http_host: str = flag("", "address the OpenAI REST API binds (default: --host)")
    http_port: int = flag(8000, always=True)


@dataclass
class ServeConfig(Flags):
    """`prism serve`'s own flags: which stages, how many, where."""

    mode: str = flag("epd", choices=MODES)
    encoders: int = flag(1, "encoder replicas (e/pd, e/p/d)")
    gpus: list[str] = flag(
        help="GPUs for the encoders and engines: auto (every GPU shown; the default), none, "
        "a list (0,1,2: an engine per GPU while there are enough, else shared with memory "
        "fractions), or once per role, ROLE=GPUS (--gpus encoder=0 --gpus prefill=1 "
        "--gpus decode=2,3)",
        factory=list,
        metavar="GPUS",
    )
    workers: int = flag(1, "aggregated worker replicas (epd, e/pd)")
    prefill_workers: int = flag(1, "prefill worker replicas (e/p/d, ep/d)", aliases=("--prefill",))
    decode_workers: int = flag(1, "decode worker replicas (e/p/d, ep/d)", aliases=("--decode",))
    host: str = flag("127.0.0.1")
    front: str = flag(
        "combined",
        "combined: the processor also serves the OpenAI REST API (and KServe) from its own "
        "process, calling its handlers without a gRPC hop; split: a gateway process apart",
        choices=("combined", "split"),
    )
    front_workers: int = flag(
        0,
        "front processes (--front combined), sharing the HTTP, gRPC and KServe ports "
        "(SO_REUSEPORT) and the --max-in-flight bound, each routing to every engine "
        "(0: one per core the encoders and engines leave, at most 8)",
        metavar="N",
    )
    # The public gRPC API (the processor's InferenceService).
    grpc_port: int = flag(
        50050, "port of the public gRPC API, prism.v1.InferenceService (0: a free one)"
    )
    grpc_host: str = flag("", "address the public gRPC API binds (default: --host)")
    status_file: str = flag(
        "", "once ready, write every endpoint there as JSON (removed on exit)", metavar="PATH"
    )
    start_timeout: float = flag(
        1800.0,
        "seconds the stages may take to serve, each after the one it waits for (long enough "
        "for a 7B model on a GPU with compilation and CUDA graphs); on expiry the mesh stops, "
        "naming each stage still starting and its phase",
        metavar="S",
    )
    compile_cache: str = flag(
        "",
        "one directory for the compiled graphs of every engine of the mesh (vLLM's, "
        "Inductor's and Triton's caches), so that an engine started after another with the "
        "same model and settings, restarted, or started again later loads what was compiled "
        "instead of compiling (default: each library's own, ~/.cache/vllm and the "
        "temporary directory)",
        metavar="DIR",
    )
    enable_mm_embeds: bool = flag(
        False,
        "take image embeddings from clients (image_embeds parts), as vLLM's flag: checked "
        "against the model, safetensors only (never a pickle)",
    )


@dataclass
class MeshConfig(Flags):
    """Everything `prism serve` takes: the launcher hands each stage its part."""

    model: ModelConfig = nested(ModelConfig)
    serve: ServeConfig = nested(ServeConfig)
    http: HttpConfig = nested(HttpConfig)
    media: MediaConfig = nested(MediaConfig)
    engine: EngineConfig = nested(EngineConfig)
    sim: SimEngineConfig = nested(SimEngineConfig)
    sim_encoder: SimEncoderConfig = nested(SimEncoderConfig)
    routing: RoutingConfig = nested(RoutingConfig)
    transfer: TransferConfig = nested(TransferConfig)
    fetch: FetchConfig = nested(FetchConfig)
    gateway: GatewayConfig = nested(GatewayConfig)
    limit: LimitConfig = nested(LimitConfig)
    tools: ToolsConfig = nested(ToolsConfig)
    reasoning: ReasoningConfig = nested(ReasoningConfig)
    planner: PlannerConfig = nested(PlannerConfig)
    tls: TlsConfig = nested(TlsConfig)
    # Every stage takes it too (the static registry: the launcher's --peer entries).
    registry: RegistryConfig = nested(RegistryConfig)
    # Not `prism serve`'s flags: the top-level ones, vLLM's engine arguments for every
    # worker as `vllm serve` takes them, and the GPUs each engine spans.
    log: LogConfig = field(default_factory=LogConfig)
    vllm_flags: list[str] = field(default_factory=list)
    engine_gpus: int = 1


@dataclass
class WorkerStageConfig(Flags):
    """Everything `prism worker` takes."""

    address: AddressConfig = nested(AddressConfig)
    tls: TlsConfig = nested(TlsConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
    model: ModelConfig = nested(ModelConfig)
    media: MediaConfig = nested(MediaConfig)
    engine: EngineConfig = nested(EngineConfig)
    sim: SimEngineConfig = nested(SimEngineConfig)
    worker: WorkerConfig = nested(WorkerConfig)
    reasoning: ReasoningConfig = nested(ReasoningConfig)
    transfer: TransferConfig = nested(TransferConfig)
    limit: LimitConfig = nested(LimitConfig)
    registry: RegistryConfig = nested(RegistryConfig)
    connect: ConnectConfig = nested(ConnectConfig)
    # Not its flags: vLLM's engine arguments, the flags it does not know (prism.cli).
    vllm_flags: list[str] = field(default_factory=list)


@dataclass
class EncoderStageConfig(Flags):
    """Everything `prism encoder` takes."""

    address: AddressConfig = nested(AddressConfig)
    tls: TlsConfig = nested(TlsConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
    model: ModelConfig = nested(ModelConfig)
    media: MediaConfig = nested(MediaConfig)
    encoder: EncoderConfig = nested(EncoderConfig)
    sim_encoder: SimEncoderConfig = nested(SimEncoderConfig)
    transfer: TransferConfig = nested(TransferConfig)
    fetch: FetchConfig = nested(FetchConfig)
    limit: LimitConfig = nested(LimitConfig)
    registry: RegistryConfig = nested(RegistryConfig)
    connect: ConnectConfig = nested(ConnectConfig)


@dataclass
class ProcessorStageConfig(Flags):
    """Everything `prism processor` takes."""

    address: AddressConfig = nested(AddressConfig)
    tls: TlsConfig = nested(TlsConfig)
    metrics: MetricsConfig = nested(MetricsConfig)
    model: ModelConfig = nested(ModelConfig)
    media: MediaConfig = nested(MediaConfig)
    processor: ProcessorConfig = nested(ProcessorConfig)
    routing: RoutingConfig = nested(RoutingConfig)
    fetch: FetchConfig = nested(FetchConfig)
    limit: LimitConfig = nested(LimitConfig)
    tools: ToolsConfig = nested(ToolsConfig)
    reasoning: ReasoningConfig = nested(ReasoningConfig)
    registry: RegistryConfig = nested(RegistryConfig)
    peers: PeersConfig = nested(PeersConfig)
    connect: ConnectConfig = nested(ConnectConfig)


@dataclass
class FrontStageConfig(ProcessorStageConfig):
    """Everything `prism front` takes: a processor that serves the OpenAI REST API (and
    KServe) too, from the same process."""

    http: HttpConfig = nested(HttpConfig)
    gateway: GatewayConfig = nested(GatewayConfig)
    reuse_port: bool = flag(
        False,
        "share the HTTP port with other fronts (SO_REUSEPORT), as the gRPC ports are: the "
        "kernel hands each new connection to one of them (prism serve --front-workers)",
    )


@dataclass
class GatewayStageConfig(Flags):
    """Everything `prism gateway` takes."""

    address: AddressConfig = nested(AddressConfig)
    tls: TlsConfig = nested(TlsConfig)
    gateway: GatewayConfig = nested(GatewayConfig)
    limit: LimitConfig = nested(LimitConfig)
    registry: RegistryConfig = nested(RegistryConfig)
    peers: PeersConfig = nested(PeersConfig)
    connect: ConnectConfig = nested(ConnectConfig)
