"""A stage as the launcher runs it: its command line, cores, GPUs and process.

Apart from the launcher so that the plan (prism.ops.plan), the supervisor and the launcher
share it without importing one another.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prism.config.common import AddressConfig, MetricsConfig
from prism.ops import gpus
from prism.ops.phases import Progress
from prism.rpc.channel import check_health
from prism.runtime.ports import free_port

if TYPE_CHECKING:
    from prism.ops.template import Forked

_PR_SET_PDEATHSIG = 1


def prepare_child(cpus: set[int]) -> None:
    """Runs in the child before exec: dies with the launcher, keeps to its cores."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus:
        os.sched_setaffinity(0, cpus)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def core_slices(engines: int) -> list[set[int]]:
    """The CPU cores of each engine. On the CPU backend, engines whose OpenMP threads
    share cores run many times slower, and an engine holding KV for a decode polls
    without pause: each engine, with all its processes, stays on its own cores. With
    more engines than cores, the first ones (prefills come first) still get a core of
    their own and the last ones share the last core."""
    cores = sorted(os.sched_getaffinity(0))
    if engines > len(cores):
        return [{cores[min(i, len(cores) - 1)]} for i in range(engines)]
    size = len(cores) // engines
    return [set(cores[i * size : (i + 1) * size]) for i in range(engines)]


def grpc_stage(
    name: str, host: str, argv: list[str], port: int = 0, reach: str = "", servers: int = 1
) -> StageProcess:
    """A gRPC stage bound to `host` at `port` (0: a free one), or with several `servers`,
    at that port and the next ones; `reach`: the host to reach it at where `host` is a
    wildcard."""
    port = port or free_port(host, servers)
    addresses = [f"{reach or host}:{port + i}" for i in range(servers)]
    metrics_port = free_port(host)
    return StageProcess(
        name,
        addresses[0],
        [*argv, *AddressConfig(host, port).to_argv(),
         *MetricsConfig(metrics_port=metrics_port).to_argv()],
        lambda: all(check_health(address) for address in addresses),
        metrics_url=f"http://{reach or host}:{metrics_port}/metrics",
        replicas=addresses,
    )  # fmt: skip


@dataclass
class StageProcess:
    """A stage as the launcher runs it: its command line, and where and how it runs."""

    name: str
    address: str
    argv: list[str]
    healthy: Callable[[], bool]
    # The addresses of its gRPC servers, each its own replica to its peers (a process of
    # several simulated engines); `address` is the first.
    replicas: list[str] = field(default_factory=list)
    metrics_url: str = ""
    # Where its OpenAI REST API answers, if it serves one (a gateway, or a front).
    url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # CPU cores the stage's processes may run on (all when empty).
    cpus: set[int] = field(default_factory=set)
    # The GPUs it runs on (none: the CPU) and, for a vLLM engine, its share of their memory.
    placement: gpus.Placement = field(default_factory=lambda: gpus.Placement(()))
    # The stages that must be serving before this one starts (`plan`: stages that share a
    # GPU, or engines that compile the same graphs).
    after: list[str] = field(default_factory=list)
    # The least level of vLLM's lines that its output shows (prism.ops.phases), and
    # whether each line of it begins with its name (not where the lines are JSON objects).
    log_level: str = "INFO"
    tag_lines: bool = True
    # A directory of the launcher's making that the stage writes, removed once the mesh
    # stops ("": none).
    scratch: str = ""
    # Spawned, or forked from the launcher's template (prism.ops.template).
    process: subprocess.Popen | Forked | None = None
    progress: Progress = field(default_factory=Progress)
