"""A NetworkPolicy per stage: each is reached only by the stages that call it, on the ports
they call.

gRPC: the gateway takes anyone (the door); the processor only the gateway; the encoder
and the engines only the processor, the stage that routes among them (the gateway and the
processor are the only stages that call others over gRPC). NIXL: a reader dials the
owner's UCX listeners (UCX_TCP_PORT_RANGE) and the owner never dials back, so the encoder
takes the engines that read its embeddings (the aggregated worker in E/PD, prefill in
E/P/D), and prefill takes decode, which fetches its engine's metadata on the KV side
channel and then reads its KV. Besides: Prometheus from its namespace on the metrics
port; with Consul, its servers on the port their checks call; with Connect, the callers'
sidecars on the stage's sidecar instead of the stage. The planner, where there is one,
reads the processor's metrics port and is reached only by Prometheus, on its own. Probes
need no rule: traffic from the pod's own node is always allowed.

The policies govern ingress alone: within the mesh a pod reaches only what the others let
in, and the API server, which the stages that read EndpointSlices and the planner call,
stays reachable (an egress rule would have to name its address and port, each cluster's
own).
"""

from __future__ import annotations

from typing import Any

from prism.ops.deploy.ports import (
    CONNECT_INBOUND_PORT,
    HEALTH_PORT,
    KV_PORT,
    METRICS_PORT,
    UCX_PORTS,
    port,
)

# The stages that call others over gRPC, and so discover them.
CALLERS = ("gateway", "processor")
# The stage whose metrics the planner reads: the processor times every request and every
# stage call (the gateway, apart in a deployment, has no metrics port).
FRONT = "processor"


def grpc_callers(kind: str) -> tuple[str, ...]:
    """The stages that call `kind` over gRPC; the gateway's callers are outside."""
    if kind == "gateway":
        return ()
    return ("gateway",) if kind == "processor" else ("processor",)


def nixl_callers(kind: str, kinds: list[str]) -> tuple[str, ...]:
    """The stages of `kinds` that read NIXL memory from `kind`."""
    if kind == "encoder":
        return tuple(k for k in ("worker", "prefill") if k in kinds)
    if kind == "prefill" and "decode" in kinds:
        return ("decode",)
    return ()


def _tcp(number: int, end: int = 0) -> dict[str, Any]:
    rule: dict[str, Any] = {"protocol": "TCP", "port": number}
    if end:
        rule["endPort"] = end
    return rule


def _namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


def _ingress(
    kind: str,
    kinds: list[str],
    labels: dict[str, dict[str, str]],
    discovery: str,
    consul_namespace: str,
    metrics_namespace: str,
    tls: bool,
    planner: dict[str, str] | None,
) -> list[dict[str, Any]]:
    """The ingress rules of stage `kind` among the mesh's `kinds` (`labels`: each stage's
    pod labels; `planner`: the planner's, if there is one)."""

    def pods(*callers: str) -> list[dict[str, Any]]:
        return [{"podSelector": {"matchLabels": labels[caller]}} for caller in callers]

    if kind == "gateway":
        return [{"ports": [_tcp(port(kind))]}]  # anyone: Consul's check and /metrics too
    served = CONNECT_INBOUND_PORT if discovery == "connect" else port(kind)
    rules = [{"from": pods(*grpc_callers(kind)), "ports": [_tcp(served)]}]
    if readers := nixl_callers(kind, kinds):
        ports = [_tcp(*UCX_PORTS)]
        if kind == "prefill":
            ports.insert(0, _tcp(KV_PORT))
        rules.append({"from": pods(*readers), "ports": ports})
    rules.append({"from": [_namespace(metrics_namespace)], "ports": [_tcp(METRICS_PORT)]})
    if planner and kind == FRONT:
        rules.append({"from": [{"podSelector": {"matchLabels": planner}}],
                      "ports": [_tcp(METRICS_PORT)]})  # fmt: skip
    if discovery == "consul":
        checked = HEALTH_PORT if tls else port(kind)
        rules.append({"from": [_namespace(consul_namespace)], "ports": [_tcp(checked)]})
    return rules


def _policy(
    mesh: str, namespace: str, kind: str, labels: dict[str, str], ingress: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{mesh}-{kind}", "namespace": namespace, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def policies(
    mesh: str,
    namespace: str,
    labels: dict[str, dict[str, str]],
    discovery: str,
    consul: str,
    metrics_namespace: str,
    tls: bool,
    planner: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The NetworkPolicy of each stage of the mesh named `mesh` (`labels`: each stage's
    pod labels; `consul`: Consul's HOST:PORT), and of its planner (`planner`: its pod
    labels) if it has one."""
    # consul-server.consul:8500: the Service `consul-server` of the namespace `consul`.
    host = consul.rpartition(":")[0] or consul
    consul_namespace = host.split(".")[1] if "." in host else namespace
    kinds = list(labels)
    out = [
        _policy(mesh, namespace, kind, labels[kind], _ingress(
            kind, kinds, labels, discovery, consul_namespace, metrics_namespace, tls, planner
        ))
        for kind in kinds
    ]  # fmt: skip
    if planner:
        scraped = [{"from": [_namespace(metrics_namespace)], "ports": [_tcp(METRICS_PORT)]}]
        out.append(_policy(mesh, namespace, "planner", planner, scraped))
    return out
