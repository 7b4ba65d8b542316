"""The configs several commands share: logging, TLS, a stage's address and metrics, the
model and its media limits, how embeddings travel, what image URLs may reach, the bound
on requests in flight, routing and vLLM's output parsers. `prism serve` takes most of
them and hands each to the stages that take it (prism.ops.launcher)."""

from __future__ import annotations

from dataclasses import dataclass

from prism import logs
from prism.config.flags import Flags, flag


@dataclass
class LogConfig(Flags):
    log_level: str = flag("info", "debug, info, warning, error", always=True)
    log_format: str = flag("text", "json: one object per line, with the request id",
                           choices=logs.FORMATS, always=True)  # fmt: skip


@dataclass
class TlsConfig(Flags):
    group = "TLS between services (off unless --tls-cert is given)"

    tls_cert: str = flag("", "this service's certificate (PEM)")
    tls_key: str = flag("", "its private key (PEM)")
    tls_ca: str = flag(
        "",
        "CA that signed the peers' certificates (PEM); servers then require client "
        "certificates too (mutual TLS). Default: the system's roots, no client certificates",
    )
    tls_server_name: str = flag("", "name to expect in servers' certificates")


@dataclass
class AddressConfig(Flags):
    """Where a stage listens, and how it stops (its port's default is the stage's own)."""

    host: str = flag("127.0.0.1", "address to bind (default: loopback)", always=True)
    port: int = flag(0, "port to serve (0: a free one)", always=True)
    shutdown_grace_s: float = flag(
        10.0,
        "on SIGTERM: stop taking requests, let those in flight finish (and decodes read "
        "the KV a prefill holds for them) for this long, then abort them",
    )
    standby: bool = flag(
        False,
        "start as a warm spare: ready, but NOT_SERVING until SIGUSR1 (the planner's local "
        "backend keeps one for a role to grow into)",
    )
    reuse_port: bool = flag(
        False,
        "share this stage's ports (gRPC, HTTP, KServe) with the processes that ask the same "
        "(SO_REUSEPORT), the kernel handing each new connection to one of them (prism serve "
        "--front-workers); without it a port another process listens on is refused",
    )


@dataclass
class MetricsConfig(Flags):
    metrics_port: int = flag(0, "Prometheus /metrics port (0: none)")
    health_port: int = flag(
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port: for probes and "
        "Consul checks, which cannot present a client certificate under mutual TLS "
        "(0: none)",
    )


@dataclass
class ModelConfig(Flags):
    model: str = flag(help="model directory or hub id")
    served_model_name: str = flag("", "name clients use (default: --model as given)")
    max_model_len: int = flag(0, "context length (default: the model's)")


@dataclass
class MediaConfig(Flags):
    """What one request may bring, which every stage checks alike."""

    max_images: int = flag(8, "images per request")
    max_videos: int = flag(4, "videos per request")
    video_frames: int = flag(
        32,
        "frames taken from each video, evenly spread (vLLM's num_frames); models whose "
        "video loader samples by rate (the Qwen2-VL family) take --video-fps instead",
    )
    video_fps: float = flag(
        0,
        "frames a second that rate-sampling video loaders take (0: the loader's own, "
        "2 for Qwen2-VL)",
    )
    max_video_mib: int = flag(64, "bytes of one video (MiB)")
    max_video_seconds: float = flag(600, "length of one video (seconds)")
    max_video_frames: int = flag(
        36_000, "frames in one video's container (all are read past, not only those taken)"
    )
    max_video_pixels: int = flag(3840 * 2160, "pixels of one video frame")
    max_audios: int = flag(4, "audio clips per request")
    max_audio_mib: int = flag(25, "bytes of one audio clip (MiB)")
    max_audio_seconds: float = flag(600, "length of one audio clip (seconds)")


# The ways embeddings travel (prism.transfer, one implementation each).
TRANSFERS = ("nixl", "inline")


@dataclass
class TransferConfig(Flags):
    transfer: str = flag(
        "nixl",
        "how image embeddings go from encoder to worker: nixl (the worker pulls them "
        "from the encoder's memory) or inline (in the gRPC message; no NIXL needed)",
        choices=TRANSFERS,
        always=True,
    )


@dataclass
class FetchConfig(Flags):
    fetch_allow: list[str] = flag(
        help="let image URLs reach this host name or network although it is not public "
        "(loopback, private, link-local); repeatable. Default: public addresses only",
        factory=list,
        metavar="HOST|CIDR",
    )


@dataclass
class LimitConfig(Flags):
    max_in_flight: int = flag(
        256,
        "requests this stage takes at once; past it, RESOURCE_EXHAUSTED / HTTP 429 "
        "with Retry-After (0: no bound)",
        always=True,
    )


# How the processor may pick among replicas (prism.routing).
POLICIES = ("round-robin", "random", "least-loaded", "kv")


@dataclass
class RoutingConfig(Flags):
    routing: str = flag("round-robin", "how the processor picks among the replicas of a stage",
                        choices=POLICIES, always=True)  # fmt: skip
    kv_overlap_weight: float = flag(
        1.0,
        "--routing kv: what computing one prompt block costs, where one prompt block "
        "of a call in flight on the replica costs 1",
        always=True,
    )
    encoder_load_slack: int = flag(
        4,
        "--routing kv: an image or video goes to the encoder that owns its content hash "
        "(whose cache may hold it) unless that encoder has more than this many calls in "
        "flight beyond the least busy one's",
        minimum=0,
    )
    adapter_load_slack: int = flag(
        4,
        "--routing kv: a request for a LoRA adapter goes to the engine that owns the adapter "
        "(which then holds it loaded) unless that engine has more than this many requests "
        "in flight beyond the least busy one's",
        minimum=0,
    )


@dataclass
class ToolsConfig(Flags):
    """The processor's tool parser, as `vllm serve` takes it."""

    tool_call_parser: str = flag(
        "",
        "vLLM's tool parser for the model's calling format (e.g. hermes, llama3_json)",
        metavar="NAME",
    )
    enable_auto_tool_choice: bool = flag(
        False,
        "parse tool calls from the output (needs --tool-call-parser): tool_choice auto, "
        "and required or a named function",
    )


@dataclass
class ReasoningConfig(Flags):
    reasoning_parser: str = flag(
        "",
        "vLLM's reasoning parser for the model (e.g. deepseek_r1, qwen3): the processor "
        "splits reasoning from content, engines start structured output after reasoning",
        metavar="NAME",
    )
