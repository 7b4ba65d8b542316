"""The front of a planned mesh: the processor and the OpenAI REST API (and KServe) in one
process; in several that share their ports (`--front-workers`), the kernel handing each
new connection to one of them (SO_REUSEPORT); or a processor and a gateway apart
(`--front split`)."""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import os
import tempfile
from collections.abc import Callable

from prism.config.commands import MeshConfig
from prism.config.common import AddressConfig, LimitConfig, MetricsConfig
from prism.config.gateway import GatewayConfig, HttpConfig
from prism.config.lora import LoraConfig
from prism.config.processor import ProcessorConfig
from prism.modes import MeshRole
from prism.ops.stage_process import StageProcess, grpc_stage, http_ok
from prism.rpc.channel import check_health
from prism.rpc.ports import claim
from prism.runtime.ports import free_port

# The most fronts `--front-workers 0` starts: each holds a router, caches and a tokenizer.
MAX_AUTO = 8

Peers = Callable[[dict[str, list[StageProcess]]], list[str]]


def count(config: MeshConfig, by_role: dict[str, list[StageProcess]]) -> int:
    """`--front-workers`, or where it is 0, one front per core that no stage takes, at most
    MAX_AUTO: a vLLM engine on the CPU backend takes the cores it is bound to (all of them,
    alone); an engine on GPUs, a simulated engine and an encoder take a core each."""
    if config.serve.front_workers:
        return config.serve.front_workers
    cores = os.sched_getaffinity(0)
    taken: set[int] = set()
    others = 0
    for role, stages in by_role.items():
        for stage in stages:
            on_cpu = config.engine.engine == "vllm" and not stage.placement.gpus
            if role != MeshRole.ENCODER and on_cpu:
                taken |= stage.cpus or cores
            else:
                others += 1
    return max(1, min(MAX_AUTO, len(cores - taken) - others))


def plan(
    config: MeshConfig,
    head: list[str],
    model: Callable[[MeshConfig], list[str]],
    peers: Peers,
    by_role: dict[str, list[StageProcess]],
) -> list[StageProcess]:
    """The front's processes: `head` starts a stage's command line, `model(config)` gives
    the flags of a stage that holds the model, `peers(by_role)` the static registry's
    entries."""
    grpc_host = config.serve.grpc_host or config.serve.host
    own = ProcessorConfig(config.serve.mode, enable_mm_embeds=config.serve.enable_mm_embeds)
    http = HttpConfig(config.http.http_host or config.serve.host, config.http.http_port)
    reach = config.serve.host if _is_wildcard(grpc_host) else ""
    if config.serve.front == "split" and config.serve.front_workers > 1:
        raise ValueError("--front-workers needs --front combined: a split front is one "
                         "gateway and one processor")  # fmt: skip
    workers = count(config, by_role) if config.serve.front == "combined" else 1
    # The mesh's bound on requests in flight, shared out among its fronts.
    bound = config.limit.max_in_flight
    limit = LimitConfig(bound and max(1, bound // workers))
    gateway_config, lora, scratch = _scratch(config, workers)
    argv = [*config.fetch.to_argv(), *own.to_argv(), *config.routing.to_argv(),
            *limit.to_argv(), *config.tools.to_argv(), *config.reasoning.to_argv(),
            *lora.to_argv(), *peers(by_role)]  # fmt: skip
    base_url = f"http://{http.http_host}:{http.http_port}"
    kserve_port = config.gateway.kserve_grpc_port
    doors_healthy = functools.partial(
        _doors_healthy, base_url, f"{http.http_host}:{kserve_port}" if kserve_port else ""
    )
    # In the environment rather than the command line, where `ps` would show it.
    env = {"PRISM_API_KEY": config.gateway.api_key}
    if config.serve.front == "split":
        processor = grpc_stage("processor", grpc_host, [*head, "processor", *model(config), *argv],
                               port=config.serve.grpc_port, reach=reach)  # fmt: skip
        processor.scratch = scratch
        gateway = StageProcess(
            "gateway",
            base_url,
            [*head, "gateway", *AddressConfig(http.http_host, http.http_port).to_argv(),
             *config.gateway.to_argv(), *limit.to_argv(), *config.registry.to_argv(),
             *config.tls.to_argv(), *peers({"processor": [processor]})],
            doors_healthy,
            metrics_url=f"{base_url}/metrics",
            url=base_url,
            env=env,
        )  # fmt: skip
        return [processor, gateway]
    argv = [*argv, *http.to_argv(), *gateway_config.to_argv()]
    if workers == 1:
        front = grpc_stage("front", grpc_host, [*head, "front", *model(config), *argv],
                           port=config.serve.grpc_port, reach=reach)  # fmt: skip
        grpc_healthy = front.healthy
        front.healthy = lambda: grpc_healthy() and doors_healthy()
        front.url = base_url
        front.env.update(env)
        front.scratch = scratch
        return [front]
    # The ports the fronts share are chosen once.
    port = config.serve.grpc_port or free_port(grpc_host)
    shared = []
    for i in range(workers):
        # Each its own Consul registration, and its own health port: the shared ports
        # answer for whichever front the kernel picks.
        registry = dataclasses.replace(config.registry, consul_id_suffix=f"front-{i}")
        held = model(dataclasses.replace(config, registry=registry))
        health_port = free_port(grpc_host)
        health = [*MetricsConfig(health_port=health_port).to_argv(), "--reuse-port"]
        front = grpc_stage(f"front-{i}", grpc_host, [*head, "front", *held, *argv, *health],
                           port=port, reach=reach)  # fmt: skip
        own_health = f"{reach or grpc_host}:{health_port}"
        front.healthy = functools.partial(_front_healthy, own_health, doors_healthy)
        front.url = base_url
        front.env.update(env)
        front.scratch = scratch
        shared.append(front)
    return shared


def claim_ports(config: MeshConfig) -> list[int | None]:
    """Refuses (PortInUse) the mesh's doors where another process listens or another mesh
    has claimed them, and claims them for this one (the locks' descriptors, held for the
    launcher's life): checked before any stage starts, since the fronts that share their
    ports (SO_REUSEPORT) would share them with another mesh's too."""
    grpc_host = config.serve.grpc_host or config.serve.host
    http_host = config.http.http_host or config.serve.host
    return [
        claim("gRPC API", grpc_host, config.serve.grpc_port),
        claim("HTTP", http_host, config.http.http_port),
        claim("KServe gRPC", http_host, config.gateway.kserve_grpc_port),
    ]


def _scratch(config: MeshConfig, workers: int) -> tuple[GatewayConfig, LoraConfig, str]:
    """The gateway's and the LoRA flags of the fronts, with what they keep outside their
    memory in a directory of this mesh's own that only its user can read and that goes
    with the mesh (the directory too, "" where there is none): the response store, where
    fronts share their ports (a follow-up reaches whichever the kernel picks;
    conversations are in it), and the adapters loaded at run time (every front serves
    them, one started again too)."""
    gateway, lora = config.gateway, config.lora
    share_store = workers > 1 and not gateway.responses_store
    keep_adapters = bool(lora.allowed_lora_dirs) and not lora.lora_state
    if not (share_store or keep_adapters):
        return gateway, lora, ""
    directory = tempfile.mkdtemp(prefix="prism-front-")
    if share_store:
        store = os.path.join(directory, "responses.sqlite3")
        gateway = dataclasses.replace(gateway, responses_store=store)
    if keep_adapters:
        lora = dataclasses.replace(lora, lora_state=os.path.join(directory, "adapters.json"))
    return gateway, lora, directory


def _front_healthy(own_health: str, doors_healthy: Callable[[], bool]) -> bool:
    return check_health(own_health) and doors_healthy()


def _doors_healthy(base_url: str, kserve_address: str) -> bool:
    """/health, and the KServe port's gRPC health where it is served: both doors open."""
    if not http_ok(f"{base_url}/health"):
        return False
    return not kserve_address or check_health(kserve_address, "inference.GRPCInferenceService")


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name
