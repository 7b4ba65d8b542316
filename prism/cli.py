"""`prism serve | worker | processor | gateway | model build | health | deploy kubernetes`.

Heavy imports (vLLM, torch) happen inside the subcommand that needs them, so the gateway
and the launcher start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

from prism import logs, registry, transfer
from prism.modes import MODES, EngineRole
from prism.routing import POLICIES
from prism.services.worker.sim_engine import SimConfig


def _tls_args(parser: argparse.ArgumentParser) -> None:
    tls = parser.add_argument_group("TLS between services (off unless --tls-cert is given)")
    tls.add_argument("--tls-cert", default="", help="this service's certificate (PEM)")
    tls.add_argument("--tls-key", default="", help="its private key (PEM)")
    tls.add_argument(
        "--tls-ca",
        default="",
        help="CA that signed the peers' certificates (PEM); servers then require client "
        "certificates too (mutual TLS). Default: the system's roots, no client certificates",
    )
    tls.add_argument(
        "--tls-server-name", default="", help="name to expect in servers' certificates"
    )


def _forward(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    """The flags `names` of `args` that are set, as a command line for a stage."""
    forwarded = []
    for name in names:
        if value := getattr(args, name):
            forwarded += [f"--{name.replace('_', '-')}", str(value)]
    return forwarded


def _stage_args(parser: argparse.ArgumentParser, port: int, metrics: bool = True) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=port)
    _tls_args(parser)
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=10.0,
        help="on SIGTERM: stop taking requests, let those in flight finish for this long, "
        "then abort them",
    )
    if metrics:
        parser.add_argument(
            "--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: none)"
        )
        parser.add_argument(
            "--health-port",
            type=int,
            default=0,
            help="also serve grpc.health.v1 alone, in plaintext, on this port: for probes and "
            "Consul checks, which cannot present a client certificate under mutual TLS "
            "(0: none)",
        )


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory or hub id")
    parser.add_argument(
        "--served-model-name", default="", help="name clients use (default: --model as given)"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="context length (default: the model's)"
    )
    _media_args(parser)


# The media flags, which `prism serve` hands to every stage alike.
MEDIA_FLAGS = ("max_images", "max_videos", "video_frames", "video_fps", "max_video_mib",
               "max_video_seconds", "max_video_frames", "max_video_pixels")  # fmt: skip


def _media_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-images", type=int, default=8, help="images per request")
    parser.add_argument("--max-videos", type=int, default=4, help="videos per request")
    parser.add_argument(
        "--video-frames",
        type=int,
        default=32,
        help="frames taken from each video, evenly spread (vLLM's num_frames); models whose "
        "video loader samples by rate (the Qwen2-VL family) take --video-fps instead",
    )
    parser.add_argument(
        "--video-fps",
        type=float,
        default=0,
        help="frames a second that rate-sampling video loaders take (0: the loader's own, "
        "2 for Qwen2-VL)",
    )
    parser.add_argument("--max-video-mib", type=int, default=64, help="bytes of one video (MiB)")
    parser.add_argument(
        "--max-video-seconds", type=float, default=600, help="length of one video (seconds)"
    )
    parser.add_argument(
        "--max-video-frames",
        type=int,
        default=36_000,
        help="frames in one video's container (all are read past, not only those taken)",
    )
    parser.add_argument(
        "--max-video-pixels", type=int, default=3840 * 2160, help="pixels of one video frame"
    )


def _embeds_arg(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--enable-mm-embeds", action="store_true", help=help)


def _transfer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transfer",
        default="nixl",
        choices=transfer.KINDS,
        help="how image embeddings go from encoder to worker: nixl (the worker pulls them "
        "from the encoder's memory) or inline (in the gRPC message; no NIXL needed)",
    )


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype", default="auto", help="weights dtype (auto: float32 on CPU, else the model's)"
    )
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache size on CPU (GiB)")
    parser.add_argument(
        "--engine",
        choices=("vllm", "sim"),
        default="vllm",
        help="vllm, or sim: a simulated engine without a model (vLLM-like batching and "
        "prefix cache, timing from the --sim-* flags), for routing, migration and load",
    )
    sim = parser.add_argument_group("simulated engine (--engine sim)")
    defaults = SimConfig()
    sim.add_argument(
        "--sim-prefill-tokens-per-s",
        type=float,
        default=defaults.prefill_tokens_per_s,
        help="prompt tokens computed a second",
    )
    sim.add_argument(
        "--sim-decode-step-ms",
        type=float,
        default=defaults.decode_step_s * 1000,
        help="time of each step, besides its prompt tokens",
    )
    sim.add_argument(
        "--sim-block-size", type=int, default=defaults.block_size, help="tokens per KV block"
    )
    sim.add_argument(
        "--sim-kv-blocks", type=int, default=defaults.num_blocks, help="KV cache size in blocks"
    )
    sim.add_argument(
        "--sim-max-num-seqs",
        type=int,
        default=defaults.max_num_seqs,
        help="sequences a step may hold",
    )
    sim.add_argument(
        "--sim-max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens a step may compute",
    )
    sim.add_argument(
        "--sim-media-tokens",
        type=int,
        default=16,
        help="prompt tokens an image or video file takes",
    )
    sim.add_argument("--sim-kv-tokens-per-s", type=float, default=1_000_000.0,
                     help="decode: prompt tokens of KV read from prefill a second")  # fmt: skip


# The simulated engine's flags, as `prism serve` forwards them to its workers.
SIM_FLAGS = ("sim_prefill_tokens_per_s", "sim_decode_step_ms", "sim_block_size", "sim_kv_blocks",
             "sim_max_num_seqs", "sim_max_num_batched_tokens", "sim_media_tokens",
             "sim_kv_tokens_per_s")  # fmt: skip


def _fetch_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fetch-allow",
        action="append",
        default=[],
        metavar="HOST|CIDR",
        help="let image URLs reach this host name or network although it is not public "
        "(loopback, private, link-local); repeatable. Default: public addresses only",
    )


def _gateway_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PRISM_API_KEY", ""),
        help="require 'Authorization: Bearer KEY' on /v1 (default: PRISM_API_KEY; none if unset)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=0,
        help="seconds a generation may take before it ends with 504 (0: no limit)",
    )


def _kserve_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kserve-grpc-port",
        type=int,
        default=0,
        help="also serve KServe v2 gRPC (inference.GRPCInferenceService, as Triton with its "
        "vLLM backend) on this port (0: not served)",
    )


def _limit_arg(parser: argparse.ArgumentParser, default: int = 256) -> None:
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=default,
        help="requests this stage takes at once; past it, RESOURCE_EXHAUSTED / HTTP 429 "
        "with Retry-After (0: no bound)",
    )


def _routing_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--routing",
        default="round-robin",
        choices=POLICIES,
        help="how the processor picks among the replicas of a stage",
    )
    parser.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=1.0,
        help="--routing kv: what computing one prompt block costs, where one prompt block "
        "of a call in flight on the replica costs 1",
    )


def _reasoning_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--reasoning-parser",
        default="",
        metavar="NAME",
        help="vLLM's reasoning parser for the model (e.g. deepseek_r1, qwen3): the processor "
        "splits reasoning from content, engines start structured output after reasoning",
    )


def _parser_args(parser: argparse.ArgumentParser) -> None:
    """The processor's output parsers, as `vllm serve` takes them."""
    parser.add_argument(
        "--tool-call-parser",
        default="",
        metavar="NAME",
        help="vLLM's tool parser for the model's calling format (e.g. hermes, llama3_json)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls from the output (needs --tool-call-parser): tool_choice auto, "
        "and required or a named function",
    )
    _reasoning_arg(parser)


def _forwarded_registry_args(args: argparse.Namespace) -> list[str]:
    """`prism serve`'s registry flags, as every stage it starts takes them."""
    if args.registry == "static":
        return []
    return _forward(args, ("registry", "advertise_host", "consul_token", "consul_check_interval",
                           "consul_check_timeout", "consul_deregister_after"))  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description=__doc__)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--log-format",
        default="text",
        choices=logs.FORMATS,
        help="json: one object per line, with the request id",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run every stage of a mode as local processes")
    serve.add_argument("--mode", default="epd", choices=MODES)
    serve.add_argument("--encoders", type=int, default=1, help="encoder replicas (e/pd, e/p/d)")
    serve.add_argument(
        "--gpus",
        action="append",
        default=[],
        metavar="GPUS",
        help="GPUs for the encoders and engines: auto (every GPU shown; the default), none, "
        "a list (0,1,2: an engine per GPU while there are enough, else shared with memory "
        "fractions), or once per role, ROLE=GPUS (--gpus encoder=0 --gpus prefill=1 "
        "--gpus decode=2,3)",
    )
    serve.add_argument(
        "--workers", type=int, default=1, help="aggregated worker replicas (epd, e/pd)"
    )
    serve.add_argument(
        "--prefill",
        "--prefill-workers",
        dest="prefill_workers",
        type=int,
        default=1,
        help="prefill worker replicas (e/p/d, ep/d)",
    )
    serve.add_argument(
        "--decode",
        "--decode-workers",
        dest="decode_workers",
        type=int,
        default=1,
        help="decode worker replicas (e/p/d, ep/d)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    _transfer_arg(serve)
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument(
        "--grpc-port",
        type=int,
        default=50050,
        help="port of the public gRPC API, prism.v1.InferenceService (0: a free one)",
    )
    serve.add_argument(
        "--grpc-host", default="", help="address the public gRPC API binds (default: --host)"
    )
    _kserve_arg(serve)
    serve.add_argument(
        "--status-file",
        default="",
        metavar="PATH",
        help="once ready, write every endpoint there as JSON (removed on exit)",
    )
    _model_args(serve)
    _embeds_arg(
        serve,
        "take image embeddings from clients (image_embeds parts), as vLLM's flag: checked "
        "against the model, safetensors only (never a pickle)",
    )
    _engine_args(serve)
    _routing_arg(serve)
    _fetch_args(serve)
    _gateway_args(serve)
    _limit_arg(serve)
    _parser_args(serve)
    _tls_args(serve)
    registry.add_arguments(serve, sidecar=False)

    worker = sub.add_parser("worker", help="EngineService on a vLLM (or simulated) engine")
    _stage_args(worker, 50051)
    _model_args(worker)
    _engine_args(worker)
    worker.add_argument(
        "--role",
        default=EngineRole.AGGREGATED,
        type=EngineRole,
        choices=list(EngineRole),
        help="aggregated: whole answers; prefill (images as embeddings) and encode_prefill "
        "(images as pixels): the prompt's KV cache and first token; decode: the rest",
    )
    worker.add_argument("--seed", type=int, default=0)
    _reasoning_arg(worker)
    _embeds_arg(
        worker,
        "take precomputed embeddings (an encoder's, read over NIXL, or a client's, inline) "
        "instead of images (implied by --role prefill and decode)",
    )
    worker.add_argument(
        "--kv-host",
        default="",
        help="address of the KV side channel that decode workers connect to (default: --host)",
    )
    worker.add_argument(
        "--kv-port", type=int, default=0, help="KV side channel port (default: a free port)"
    )
    worker.add_argument(
        "--kv-lease-s",
        type=int,
        default=30,
        help="prefill roles: free a prompt's KV after this long if no decode reads it",
    )
    worker.add_argument("--pool-mib", type=int, default=256, help="NIXL read buffer (MiB)")
    _transfer_arg(worker)
    worker.add_argument(
        "--engine-nice",
        type=int,
        default=None,
        help="run the engine's processes this much nicer than the mesh's request path "
        "(default: 10 on the CPU backend, where they share its cores; 0 elsewhere)",
    )
    _limit_arg(worker)
    registry.add_arguments(worker)

    encoder = sub.add_parser("encoder", help="EncoderService: vision tower + projector")
    _stage_args(encoder, 50052)
    _model_args(encoder)
    encoder.add_argument("--pool-mib", type=int, default=256, help="NIXL embedding pool (MiB)")
    _transfer_arg(encoder)
    encoder.add_argument("--cache-mib", type=int, default=256, help="embedding cache (MiB)")
    encoder.add_argument(
        "--device",
        default="auto",
        help="where the vision path runs and its embeddings are published: cpu, cuda, "
        "cuda:N (auto: the accelerator when there is one)",
    )
    encoder.add_argument(
        "--dtype",
        default="auto",
        help="the vision path's dtype (auto: float32 on CPU, as the CPU engine; else the "
        "checkpoint's 16-bit dtype)",
    )
    encoder.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="most items (images, or videos) of concurrent requests encoded in one pass",
    )
    encoder.add_argument(
        "--batch-wait-ms",
        type=float,
        default=2.0,
        help="how long an item waits for others to share its forward pass",
    )
    encoder.add_argument(
        "--lease-s", type=float, default=30.0, help="free unread embeddings after this long"
    )
    _fetch_args(encoder)
    _limit_arg(encoder)
    registry.add_arguments(encoder)

    processor = sub.add_parser("processor", help="the public InferenceService")
    _stage_args(processor, 50050)
    _model_args(processor)
    processor.add_argument("--mode", default="epd", choices=MODES)
    _embeds_arg(processor, "take image embeddings from clients (image_embeds parts)")
    _routing_arg(processor)
    _fetch_args(processor)
    _limit_arg(processor)
    _parser_args(processor)
    processor.add_argument(
        "--migration-limit",
        type=int,
        default=1,
        help="times a request moves to another worker replica when the one streaming it dies",
    )
    registry.add_arguments(processor, peers="worker=127.0.0.1:50051")

    gateway = sub.add_parser("gateway", help="OpenAI REST API in front of a processor")
    _stage_args(gateway, 8000, metrics=False)
    _gateway_args(gateway)
    _kserve_arg(gateway)
    _limit_arg(gateway)
    registry.add_arguments(gateway, peers="processor=127.0.0.1:50050")

    model = sub.add_parser("model", help="random-weight models for tests, demos and benchmarks")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser("build", help="write a random-weight checkpoint")
    kind = build.add_mutually_exclusive_group(required=True)
    kind.add_argument("--family", help="a tiny model of this family: llava, qwen2-vl or qwen2.5-vl")
    kind.add_argument(
        "--preset",
        help="the exact architecture of a published checkpoint (qwen2-vl-2b, qwen2-vl-7b, "
        "llava-1.5-7b), its size and dtype, for GPU benchmarks",
    )
    build.add_argument("--out", required=True)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument(
        "--size", default="tiny", choices=["tiny", "small"],
        help="with --family; small: a larger language model, for benchmarks where prefill "
        "should cost",
    )  # fmt: skip

    health = sub.add_parser(
        "health", help="exit 0 when a stage reports SERVING, else 1 (a container's health check)"
    )
    health.add_argument(
        "target",
        nargs="?",
        default=os.environ.get("PRISM_HEALTH", ""),
        help="HOST:PORT of a stage's grpc.health.v1, or the gateway's http://HOST:PORT/health "
        "(default: PRISM_HEALTH; without either, a container that serves nothing, such as "
        "`prism model build`: exit 0)",
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for it")
    _tls_args(health)

    deploy = sub.add_parser("deploy", help="deployment manifests of a mesh")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True)
    kube = deploy_sub.add_parser(
        "kubernetes", help="a Deployment, Service and PodDisruptionBudget per stage of a mode"
    )
    kube.add_argument("--mode", default="e/p/d", choices=MODES)
    kube.add_argument("--model", required=True, help="the model's path (in the pod) or hub id")
    kube.add_argument("--name", default="prism", help="prefix of every object's name")
    kube.add_argument(
        "--namespace",
        default="prism",
        help="the mesh's own namespace, which the manifests create (Pod Security: restricted)",
    )
    kube.add_argument(
        "--image",
        default="",
        help="the image, by a fixed tag or REPO@sha256:DIGEST (default: prism:VERSION, as "
        "this checkout builds it)",
    )
    kube.add_argument("--model-pvc", default="", help="a PersistentVolumeClaim mounted at /models")
    kube.add_argument(
        "--tiny-model", default="", choices=["", "llava", "qwen2-vl"],
        help="each pod builds this tiny model at --model (under /models) before it starts",
    )  # fmt: skip
    for flag, what in (
        ("--replicas", "replicas of STAGE (default 1)"),
        ("--gpus", "nvidia.com/gpu per pod of STAGE"),
        ("--autoscale", "a HorizontalPodAutoscaler on STAGE, up to N replicas"),
    ):
        kube.add_argument(flag, action="append", default=[], metavar="STAGE=N", help=what)
    kube.add_argument(
        "--discovery",
        default="consul",
        choices=["consul", "connect", "kubernetes"],
        help="how stages find each other: Consul; Consul Connect (consul-k8s injects an "
        "Envoy sidecar, which carries the gRPC hops); or the API server's EndpointSlices of "
        "each stage's headless Service (no Consul needed)",
    )
    kube.add_argument(
        "--consul",
        default="consul-server.consul:8500",
        help="Consul's HTTP API, where every stage registers (consul-k8s)",
    )
    kube.add_argument("--shutdown-grace-s", type=int, default=30)
    kube.add_argument(
        "--tls-secret",
        default="prism-tls",
        help="Secret with tls.crt, tls.key and ca.crt: mutual TLS between the stages, the "
        "certificate naming NAME-mesh ('': plaintext; --discovery connect: the sidecars' "
        "mutual TLS instead)",
    )
    kube.add_argument(
        "--metrics-namespace",
        default="monitoring",
        help="the namespace whose pods (Prometheus) may reach the stages' metrics ports",
    )
    _routing_arg(kube)
    kube.add_argument("--out", default="-", help="file to write (default: stdout)")
    return parser


def _vllm_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flags: list[str]
) -> list[str]:
    """`flags`, checked by vLLM's own parser before anything starts."""
    if not flags:
        return []
    if args.engine != "vllm":
        parser.error(f"vLLM engine arguments need --engine vllm: {' '.join(flags)}")
    from prism.services.worker.engine import vllm_flags

    try:
        given = vllm_flags(flags)
    except ValueError as exc:
        parser.error(str(exc))
    args.engine_gpus = int(given.get("tensor_parallel_size", 1)) * int(  # type: ignore[call-overload]
        given.get("pipeline_parallel_size", 1)  # type: ignore[call-overload]
    )
    return flags


def _healthy(target: str, timeout: float) -> bool:
    """`prism health`: whether `target` says it serves."""
    if not target:
        return True
    if target.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(target, timeout=timeout) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False
    from prism import rpc

    return rpc.check_health(target, timeout=timeout)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Until a stage installs its graceful handler (e.g. while vLLM starts), SIGTERM must
    # unwind Python so that vLLM's finalizers stop the engine processes it spawned.
    raise SystemExit(128 + signum)


# Commands that pass the flags they do not know to vLLM's engines, as `vllm serve` reads them.
_VLLM_FLAG_COMMANDS = ("serve", "worker")


def _run_stage(serve: Coroutine[Any, Any, None]) -> int:
    """Runs a stage until it stops: 0 when told to, 1 when it could not go on."""
    from prism.runtime.stage import StageFailed

    try:
        asyncio.run(serve)
    except StageFailed as exc:
        logging.getLogger("prism").error("exiting: %s", exc)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in _VLLM_FLAG_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in _VLLM_FLAG_COMMANDS:
        args.engine_gpus = 1
        args.vllm_flags = _vllm_flags(parser, args, unknown)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logs.configure(args.log_level, args.log_format)
    if getattr(args, "tls_cert", ""):
        from prism import rpc

        rpc.configure_tls(
            rpc.Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        )
    if args.command == "serve":
        from prism.launcher import MeshConfig, run

        return run(
            MeshConfig(
                mode=args.mode,
                model=args.model,
                host=args.host,
                http_port=args.http_port,
                grpc_host=args.grpc_host,
                grpc_port=args.grpc_port,
                kserve_grpc_port=args.kserve_grpc_port,
                served_model_name=args.served_model_name,
                dtype=args.dtype,
                max_model_len=args.max_model_len,
                media_args=_forward(args, MEDIA_FLAGS),
                enable_mm_embeds=args.enable_mm_embeds,
                kv_cache_gib=args.kv_cache_gib,
                engine=args.engine,
                engine_args=_forward(args, SIM_FLAGS) if args.engine == "sim" else [],
                vllm_flags=args.vllm_flags,
                gpus=args.gpus or ["auto"],
                engine_gpus=args.engine_gpus,
                transfer=args.transfer,
                encoders=args.encoders,
                workers=args.workers,
                prefill_workers=args.prefill_workers,
                decode_workers=args.decode_workers,
                routing=args.routing,
                kv_overlap_weight=args.kv_overlap_weight,
                fetch_allow=args.fetch_allow,
                max_in_flight=args.max_in_flight,
                request_timeout=args.request_timeout,
                api_key=args.api_key,
                tool_call_parser=args.tool_call_parser,
                enable_auto_tool_choice=args.enable_auto_tool_choice,
                reasoning_parser=args.reasoning_parser,
                registry_args=_forwarded_registry_args(args),
                tls_args=_forward(args, ("tls_cert", "tls_key", "tls_ca", "tls_server_name")),
                log_level=args.log_level,
                log_format=args.log_format,
            ),
            status_file=args.status_file,
        )
    if args.command == "worker":
        from prism.services import worker

        return _run_stage(worker.serve(args))
    if args.command == "encoder":
        from prism.services import encoder

        return _run_stage(encoder.serve(args))
    if args.command == "processor":
        from prism.services.processor import serving

        return _run_stage(serving.serve(args))
    if args.command == "gateway":
        from prism.gateway import app

        app.serve(args)
        return 0
    if args.command == "health":
        return 0 if _healthy(args.target, args.timeout) else 1
    if args.command == "deploy":
        from prism.deploy import kubernetes

        try:
            text = kubernetes.render(kubernetes.manifests(kubernetes.settings_from(args)))
        except ValueError as exc:
            raise SystemExit(f"prism deploy kubernetes: {exc}") from None
        if args.out == "-":
            sys.stdout.write(text)
        else:
            with open(args.out, "w") as out:
                out.write(text)
        return 0
    if args.command == "model":
        from pathlib import Path

        from prism.presets import build_preset
        from prism.tiny_models import build

        try:
            if args.preset:
                print(build_preset(args.preset, Path(args.out), seed=args.seed))
            else:
                print(build(args.family, Path(args.out), seed=args.seed, size=args.size))
        except ValueError as exc:
            raise SystemExit(f"prism model build: {exc}") from None
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
