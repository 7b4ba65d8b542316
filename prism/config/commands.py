"""The configs of `prism serve` and of each stage command: `ServeConfig`, `prism serve`'s own
flags; `MeshConfig`, everything it takes, which the launcher hands out to the stages it
starts; a `...StageConfig` per stage command, whose flags are those of the configs it
lists (after those every stage takes, `StageConfig`), in their order."""

from __future__ import annotations

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
from prism.config.encoder import EncoderConfig
from prism.config.engine import EngineConfig, WorkerConfig
from prism.config.flags import Flags, flag, nested
from prism.config.gateway import BatchFilesConfig, GatewayConfig, HttpConfig
from prism.config.lora import LoraConfig
from prism.config.planner import PlannerConfig
from prism.config.processor import ProcessorConfig
from prism.config.registry import ConnectConfig, PeersConfig, RegistryConfig
from prism.config.sim import SimEncoderConfig, SimEngineConfig
from prism.modes import MODES


@dataclass
class ServeConfig(Flags):
    """`prism serve`'s own flags: which stages, how many, where."""

    mode: str = flag(
        "epd",
        "which stages run apart: epd (one aggregated worker), e/pd, e/p/d, ep/d",
        choices=MODES,
    )
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
    host: str = flag("127.0.0.1", "address every stage binds, and the doors unless told apart")
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
    lora: LoraConfig = nested(LoraConfig)
    tls: TlsConfig = nested(TlsConfig)
    # Every stage takes it too (the static registry: the launcher's --peer entries).
    registry: RegistryConfig = nested(RegistryConfig)
    # Not `prism serve`'s flags: the top-level ones, vLLM's engine arguments for every
    # worker as `vllm serve` takes them, and the GPUs each engine spans.
    log: LogConfig = field(default_factory=LogConfig)
    vllm_flags: list[str] = field(default_factory=list)
    engine_gpus: int = 1


@dataclass
class RunBatchConfig(MeshConfig):
    """`prism run-batch`: a batch file answered by the mesh `prism serve` would start with
    the same flags, which stops once the batch is done."""

    files: BatchFilesConfig = nested(BatchFilesConfig)


@dataclass
class StageConfig(Flags):
    """What every stage command takes: where it listens, TLS, its bound on requests in
    flight, the registry and a Consul Connect sidecar."""

    address: AddressConfig = nested(AddressConfig)
    tls: TlsConfig = nested(TlsConfig)
    limit: LimitConfig = nested(LimitConfig)
    registry: RegistryConfig = nested(RegistryConfig)
    connect: ConnectConfig = nested(ConnectConfig)


@dataclass
class ModelStageConfig(StageConfig):
    """What the stages that load the model's configuration and processor take besides."""

    metrics: MetricsConfig = nested(MetricsConfig)
    model: ModelConfig = nested(ModelConfig)
    media: MediaConfig = nested(MediaConfig)


@dataclass
class WorkerStageConfig(ModelStageConfig):
    """Everything `prism worker` takes."""

    engine: EngineConfig = nested(EngineConfig)
    sim: SimEngineConfig = nested(SimEngineConfig)
    worker: WorkerConfig = nested(WorkerConfig)
    reasoning: ReasoningConfig = nested(ReasoningConfig)
    transfer: TransferConfig = nested(TransferConfig)
    # Not its flags: vLLM's engine arguments, the flags it does not know (prism.cli).
    vllm_flags: list[str] = field(default_factory=list)


@dataclass
class EncoderStageConfig(ModelStageConfig):
    """Everything `prism encoder` takes."""

    encoder: EncoderConfig = nested(EncoderConfig)
    sim_encoder: SimEncoderConfig = nested(SimEncoderConfig)
    transfer: TransferConfig = nested(TransferConfig)
    fetch: FetchConfig = nested(FetchConfig)


@dataclass
class ProcessorStageConfig(ModelStageConfig):
    """Everything `prism processor` takes."""

    processor: ProcessorConfig = nested(ProcessorConfig)
    routing: RoutingConfig = nested(RoutingConfig)
    fetch: FetchConfig = nested(FetchConfig)
    tools: ToolsConfig = nested(ToolsConfig)
    reasoning: ReasoningConfig = nested(ReasoningConfig)
    peers: PeersConfig = nested(PeersConfig)
    lora: LoraConfig = nested(LoraConfig)


@dataclass
class FrontStageConfig(ProcessorStageConfig):
    """Everything `prism front` takes: a processor that serves the OpenAI REST API (and
    KServe) too, from the same process."""

    http: HttpConfig = nested(HttpConfig)
    gateway: GatewayConfig = nested(GatewayConfig)


@dataclass
class GatewayStageConfig(StageConfig):
    """Everything `prism gateway` takes."""

    gateway: GatewayConfig = nested(GatewayConfig)
    peers: PeersConfig = nested(PeersConfig)
