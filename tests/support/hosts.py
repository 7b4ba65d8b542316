"""Simulated hosts: network namespaces of their own, each with one address on a bridge that
the test's own namespace is on too. The test makes them and removes them; nothing leaves
this machine (root only: `available()` says why not where it cannot run).

A mesh planned for loopback is moved onto them with `place`: each stage runs in its host's
namespace (`ip netns exec`), listens on its host's address, and reaches its peers at
theirs, so that registration, health checks, routing and transfers see real addresses
and cross a real network stack.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

from prism.ops.stage_process import StageProcess, http_ok
from prism.rpc.channel import check_health
from prism.runtime import processes

LOOPBACK = "127.0.0.1"
# One /24 for the bridge: the test's namespace is .1, hosts from .10 on.
SUBNET = "10.213.7"


def available() -> str:
    """Why simulated hosts cannot be made here, or "" when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    if shutil.which("ip") is None:
        return "simulated hosts need iproute2's ip"
    return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    # The host's end of its link, in the test's namespace: down is a partition.
    link: str
    # The netem.py process that carries an impairable host's link.
    netem: subprocess.Popen | None = None

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]


class Hosts:
    """`with Hosts(["front", "gpu0"]) as hosts: hosts["gpu0"].address ...`

    The links of the hosts named in `impairable` run through tests/support/netem.py, so that
    `impair` can give them latency and loss; the others are veth pairs."""

    def __init__(self, names: list[str], impairable: tuple[str, ...] = ()):
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"prbr{tag}"
        self.impairable = impairable
        self.hosts = {
            name: Host(name, f"prism-{tag}-{name}", f"{SUBNET}.{10 + i}", f"prv{tag}{i}")
            for i, name in enumerate(names)
        }

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{SUBNET}.1/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts.values():
                _ip("netns", "add", host.namespace)
                inside = ["-n", host.namespace]
                if host.name in self.impairable:
                    inner = host.link.replace("prv", "prt")
                    host.netem = subprocess.Popen(
                        [sys.executable, str(Path(__file__).with_name("netem.py")), inner,
                         host.link],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                    )  # fmt: skip
                    if host.netem.stdout.readline().strip() != "ready":
                        raise RuntimeError(f"netem.py did not start for {host.name}")
                    _ip("link", "set", inner, "netns", host.namespace)
                    _ip(*inside, "link", "set", inner, "name", "eth0")
                else:
                    _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0",
                        "netns", host.namespace)  # fmt: skip
                _ip("link", "set", host.link, "master", self.bridge, "up")
                _ip(*inside, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip(*inside, "link", "set", "eth0", "up")
                _ip(*inside, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts.values():
            if host.netem is not None:
                # Its TAP devices go with it. (Were this process to die first, the end of
                # netem.py's stdin would end it.)
                host.netem.kill()
                processes.reap(host.netem)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        # Deleting a namespace deletes its end of the link, and so the link.
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def partition(self, name: str) -> None:
        """Cuts the host off the network (its processes live on)."""
        _ip("link", "set", self[name].link, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self[name].link, "up", "master", self.bridge)

    def impair(self, name: str, delay_s: float = 0.0, loss: float = 0.0) -> None:
        """Every frame to and from the host is delayed by `delay_s` and lost with
        probability `loss`, each way (an impairable host's link only)."""
        netem = self[name].netem
        if netem is None:
            raise ValueError(f"{name} is not impairable")
        netem.stdin.write(f"{delay_s} {loss}\n")
        netem.stdin.flush()


def _healthy(address: str, url: str) -> bool:
    """Its gRPC health (a gateway has none), and its REST API's, where it serves one."""
    grpc_ok = address.startswith("http") or check_health(address)
    return grpc_ok and (not url or http_ok(f"{url}/health"))


def place(stages: list[StageProcess], placement: dict[str, Host]) -> None:
    """Moves every stage of a loopback plan onto its host in `placement` (by stage name):
    its command runs in the host's namespace, its addresses and its peers' are the
    hosts'."""
    by_port = {stage.address.rsplit(":", 1)[1]: placement[stage.name] for stage in stages}

    def moved(text: str) -> str:
        # host:port of a stage becomes its host's address; other loopback uses stay.
        return re.sub(
            rf"{re.escape(LOOPBACK)}:(\d+)",
            lambda m: f"{by_port[m[1]].address}:{m[1]}" if m[1] in by_port else m[0],
            text,
        )

    for stage in stages:
        host = placement[stage.name]
        argv = [moved(arg) for arg in stage.argv]
        for i, arg in enumerate(argv[:-1]):
            if arg in ("--host", "--http-host"):
                argv[i + 1] = host.address
        stage.argv = host.command(argv)
        stage.address = moved(stage.address)
        stage.metrics_url = stage.metrics_url.replace(LOOPBACK, host.address)
        stage.url = stage.url.replace(LOOPBACK, host.address)
        stage.healthy = functools.partial(_healthy, stage.address, stage.url)
        # The namespaces share one kernel, where UCX would take shared memory and
        # cross-memory attach between them as on one host: TCP, as between machines.
        stage.env["UCX_TLS"] = "tcp,self"
