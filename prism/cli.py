"""`prism serve | worker | processor | gateway | planner | model build | health |
deploy kubernetes`.

Heavy imports (vLLM, torch) happen inside the subcommand that needs them, so the gateway
and the launcher start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any

import prism
from prism import logs
from prism.config import file as config_file
from prism.config.commands import (
    EncoderStageConfig,
    FrontStageConfig,
    GatewayStageConfig,
    MeshConfig,
    ProcessorStageConfig,
    RunBatchConfig,
    WorkerStageConfig,
)
from prism.config.common import LogConfig, TlsConfig
from prism.config.deploy import KubernetesConfig
from prism.config.file import ConfigFileConfig
from prism.config.flags import Flags, HelpFormatter
from prism.config.planner import PlannerStageConfig

# Every command's --help shows each flag's default.
_Parser = functools.partial(argparse.ArgumentParser, formatter_class=HelpFormatter)


def _stage(sub: argparse._SubParsersAction, name: str, help: str, port: int,
           config: type[Flags]) -> None:  # fmt: skip
    """The command of a stage serving at `port` by default, which takes `config`."""
    config.add_cli_args(sub.add_parser(name, help=help), port=port)


def _model_parser(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="random-weight models for tests, demos and benchmarks")
    model_sub = model.add_subparsers(dest="model_command", required=True, parser_class=_Parser)
    build = model_sub.add_parser("build", help="write a random-weight checkpoint")
    kind = build.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--family", help="a tiny model of this family: llava, qwen2-vl, qwen2.5-vl or qwen2-audio"
    )
    kind.add_argument(
        "--preset",
        help="the exact architecture of a published checkpoint (qwen2-vl-2b, qwen2-vl-7b, "
        "llava-1.5-7b, qwen2-audio-7b), its size and dtype, for GPU benchmarks",
    )
    build.add_argument("--out", required=True, help="directory to write the checkpoint to")
    build.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    build.add_argument(
        "--size", default="tiny", choices=["tiny", "small"],
        help="with --family; small: a larger language model, for benchmarks where prefill "
        "should cost",
    )  # fmt: skip
    lora = model_sub.add_parser(
        "build-lora", help="write a random LoRA adapter of a checkpoint (PEFT's format)"
    )
    lora.add_argument("--base", required=True, help="the checkpoint's directory")
    lora.add_argument("--out", required=True, help="directory to write the adapter to")
    lora.add_argument("--rank", type=int, default=8, help="the adapter's rank")
    lora.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def _health_parser(sub: argparse._SubParsersAction) -> None:
    health = sub.add_parser(
        "health", help="exit 0 when a stage reports SERVING, else 1 (a container's health check)"
    )
    health.add_argument(
        "target",
        nargs="?",
        default=os.environ.get("PRISM_HEALTH", ""),
        help="HOST:PORT of a stage's grpc.health.v1, or the gateway's http://HOST:PORT/health "
        "(default: PRISM_HEALTH; without either there is nothing to check: exit 2)",
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for it")
    TlsConfig.add_cli_args(health)


def _deploy_parser(sub: argparse._SubParsersAction) -> None:
    deploy = sub.add_parser("deploy", help="deployment manifests of a mesh")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True, parser_class=_Parser)
    kube = deploy_sub.add_parser(
        "kubernetes", help="a Deployment, Service and PodDisruptionBudget per stage of a mode"
    )
    KubernetesConfig.add_cli_args(kube)
    ConfigFileConfig.add_cli_args(kube)
    helm = deploy_sub.add_parser(
        "helm", help="values of the chart deploy/helm/prism: the objects `kubernetes` writes"
    )
    KubernetesConfig.add_cli_args(helm)
    ConfigFileConfig.add_cli_args(helm)


# Each command's flags are those of the typed configs it takes (prism.config), which also
# write the command lines `prism serve` starts its stages with.
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prism", description=__doc__)
    parser.add_argument("--version", action="version", version=f"prism {prism.__version__}")
    LogConfig.add_cli_args(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve = sub.add_parser("serve", help="run every stage of a mode as local processes")
    MeshConfig.add_cli_args(serve)
    RunBatchConfig.add_cli_args(sub.add_parser(
        "run-batch", help="answer a batch file (OpenAI's format) with the mesh `serve` would "
        "start, then stop, as `vllm run-batch` does"
    ))  # fmt: skip
    _stage(sub, "worker", "EngineService on a vLLM (or simulated) engine", 50051,
           WorkerStageConfig)  # fmt: skip
    _stage(sub, "encoder", "EncoderService: the model's vision and audio towers", 50052,
           EncoderStageConfig)  # fmt: skip
    _stage(sub, "processor", "the public InferenceService", 50050, ProcessorStageConfig)
    _stage(sub, "gateway", "OpenAI REST API in front of a processor", 8000, GatewayStageConfig)
    _stage(sub, "front", "a processor serving the OpenAI REST API too, in one process", 50050,
           FrontStageConfig)  # fmt: skip
    PlannerStageConfig.add_cli_args(sub.add_parser(
        "planner", help="set the replicas of each role of a deployed mesh against latency goals"
    ))  # fmt: skip
    _model_parser(sub)
    _health_parser(sub)
    _deploy_parser(sub)
    # The global flags after a command too (`prism serve --log-level debug`), as vLLM's
    # serve takes them, rather than as vLLM engine arguments.
    for command in sub.choices.values():
        LogConfig.add_cli_args(command, override=True)
    for name in _CONFIGS.keys() - {"deploy"}:
        ConfigFileConfig.add_cli_args(sub.choices[name])
    return parser


# The typed config of each command that takes --config (prism deploy kubernetes's is its
# subcommand's).
_CONFIGS: dict[str, type[Flags]] = {
    "serve": MeshConfig, "run-batch": RunBatchConfig, "worker": WorkerStageConfig,
    "encoder": EncoderStageConfig, "processor": ProcessorStageConfig, "gateway": GatewayStageConfig,
    "front": FrontStageConfig, "planner": PlannerStageConfig, "deploy": KubernetesConfig,
}  # fmt: skip


def _print_config(args: argparse.Namespace) -> int:
    """`--print-config`: the command's resolved flags as a --config file."""
    vllm = None
    if getattr(args, "vllm_flags", None):
        from prism.engine.launch import vllm_flags

        vllm = vllm_flags(args.vllm_flags)
    config = _CONFIGS[args.command].from_args(args)
    sys.stdout.write(config_file.dump([LogConfig.from_args(args), config], vllm))
    return 0


def _vllm_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, flags: list[str]
) -> list[str]:
    """`flags`, checked by vLLM's own parser before anything starts."""
    if not flags:
        return []
    if args.engine != "vllm":
        parser.error(f"vLLM engine arguments need --engine vllm: {' '.join(flags)}")
    from prism.engine.launch import vllm_flags

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
    if target.startswith(("http://", "https://")):
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(target, timeout=timeout) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False
    from prism.rpc.channel import check_health

    return check_health(target, timeout=timeout)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # Until a stage installs its graceful handler (e.g. while vLLM starts), SIGTERM must
    # unwind Python so that vLLM's finalizers stop the engine processes it spawned.
    raise SystemExit(128 + signum)


# Commands that pass the flags they do not know to vLLM's engines, as `vllm serve` reads them.
_VLLM_FLAG_COMMANDS = ("serve", "run-batch", "worker")


def _run_stage(serve: Coroutine[Any, Any, None]) -> int:
    """Runs a stage until it stops: 0 when told to, 1 when it could not go on, 2 when a
    port it was told to serve is taken."""
    from prism.rpc.ports import PortInUse
    from prism.runtime.stage import StageFailed

    try:
        asyncio.run(serve)
    except PortInUse as exc:
        return _refused(exc)
    except StageFailed as exc:
        if isinstance(exc.__cause__, PortInUse):
            return _refused(exc.__cause__)
        logging.getLogger("prism").error("exiting: %s", exc)
        return 1
    return 0


def _refused(exc: OSError) -> int:
    print(f"prism: {exc}", file=sys.stderr, flush=True)
    return 2


def _deploy(args: argparse.Namespace) -> int:
    """`prism deploy kubernetes`: the manifests, to --out; `prism deploy helm`: the chart's
    values for the same mesh."""
    from prism.ops.deploy import helm, kubernetes

    settings = KubernetesConfig.from_args(args)
    try:
        if args.deploy_command == "helm":
            text = helm.render(helm.values(settings))
        else:
            text = kubernetes.render(kubernetes.manifests(settings))
    except ValueError as exc:
        raise SystemExit(f"prism deploy {args.deploy_command}: {exc}") from None
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as out:
            out.write(text)
    return 0


def _build_model(args: argparse.Namespace) -> int:
    """`prism model build`: a random-weight checkpoint; `build-lora`: an adapter of one."""
    from pathlib import Path

    from prism.devtools.lora import build_lora
    from prism.devtools.presets import build_preset
    from prism.devtools.tiny_models import build

    try:
        if args.model_command == "build-lora":
            print(build_lora(Path(args.base), Path(args.out), rank=args.rank, seed=args.seed))
        elif args.preset:
            print(build_preset(args.preset, Path(args.out), seed=args.seed))
        else:
            print(build(args.family, Path(args.out), seed=args.seed, size=args.size))
    except ValueError as exc:
        raise SystemExit(f"prism model {args.model_command}: {exc}") from None
    return 0


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line (with its --config file's flags), vLLM's engine arguments among
    it checked by vLLM's parser."""
    parser = build_parser()
    try:
        argv = config_file.expand(argv, parser, _VLLM_FLAG_COMMANDS)
    except ValueError as exc:
        parser.error(str(exc))
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in _VLLM_FLAG_COMMANDS:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command in _VLLM_FLAG_COMMANDS:
        args.engine_gpus = 1
        args.vllm_flags = _vllm_flags(parser, args, unknown)
    if args.command == "health" and not args.target:
        # A check that checks nothing would call any container healthy.
        parser.error("health: nothing to check: give HOST:PORT or http://HOST:PORT/health, "
                     "or set PRISM_HEALTH")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if getattr(args, "print_config", False):
        return _print_config(args)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logs.configure(args.log_level, args.log_format, role=args.command)
    if getattr(args, "tls_cert", ""):
        from prism.rpc.tls import Tls, configure_tls

        configure_tls(
            Tls.from_files(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
        )
    if args.command in ("serve", "run-batch"):
        config = _CONFIGS[args.command].from_args(
            args, log=LogConfig.from_args(args), vllm_flags=args.vllm_flags,
            engine_gpus=args.engine_gpus,
        )  # fmt: skip
        if args.command == "serve":
            from prism.ops.launcher import run
        else:
            from prism.ops.run_batch import run
        return run(config)
    if args.command == "worker":
        config = WorkerStageConfig.from_args(args, vllm_flags=args.vllm_flags)
        # A simulated engine's worker loads neither vLLM nor torch.
        if config.engine.engine == "sim":
            from prism.services.sim import serving
        else:
            from prism.services.worker import serving
        return _run_stage(serving.serve(config))
    if args.command == "encoder":
        from prism.services.encoder import serving

        return _run_stage(serving.serve(EncoderStageConfig.from_args(args)))
    if args.command == "processor":
        from prism.services.processor import serving

        return _run_stage(serving.serve(ProcessorStageConfig.from_args(args)))
    if args.command == "front":
        from prism.services import front

        return _run_stage(front.serve(FrontStageConfig.from_args(args)))
    if args.command == "gateway":
        from prism.gateway import app
        from prism.rpc.ports import PortInUse

        try:
            app.serve(GatewayStageConfig.from_args(args))
        except PortInUse as exc:
            return _refused(exc)
        return 0
    if args.command == "planner":
        from prism.planner.loop import run

        try:
            return run(PlannerStageConfig.from_args(args))
        except ValueError as exc:
            raise SystemExit(f"prism planner: {exc}") from None
    if args.command == "health":
        return 0 if _healthy(args.target, args.timeout) else 1
    if args.command == "deploy":
        return _deploy(args)
    if args.command == "model":
        return _build_model(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
