"""`prism deploy kubernetes`'s config: what a deployment chooses beyond the mode's plan
(prism.ops.deploy.kubernetes writes the manifests from it)."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.common import RoutingConfig
from prism.config.flags import Flags, flag, nested
from prism.config.planner import PlannerConfig
from prism.modes import MODES


@dataclass(kw_only=True)
class KubernetesConfig(Flags):
    mode: str = flag("e/p/d", "which stages run apart, each a Deployment", choices=MODES)
    model: str = flag(help="the model's path (in the pod) or hub id")
    name: str = flag("prism", "prefix of every object's name")
    namespace: str = flag(
        "prism", "the mesh's own namespace, which the manifests create (Pod Security: restricted)"
    )
    image: str = flag(
        "",
        "the image, by a fixed tag or REPO@sha256:DIGEST (default: prism:VERSION, as "
        "this checkout builds it)",
    )
    # The model from a PersistentVolumeClaim mounted at /models, or a tiny model each pod
    # builds for itself (seeded: every pod builds the same), or else in the image.
    model_pvc: str = flag("", "a PersistentVolumeClaim mounted at /models")
    tiny_model: str = flag(
        "",
        "each pod builds this tiny model at --model (under /models) before it starts",
        choices=["", "llava", "qwen2-vl"],
    )
    # STAGE=N each.
    replicas: list[str] = flag(help="replicas of STAGE (default 1)", factory=list,
                               metavar="STAGE=N")  # fmt: skip
    gpus: list[str] = flag(help="nvidia.com/gpu per pod of STAGE", factory=list,
                           metavar="STAGE=N")  # fmt: skip
    # consul: every stage registers with Consul at `consul`; kubernetes: the API server;
    # connect: consul-k8s registers the pods and injects an Envoy sidecar into each, and
    # a stage calls each role through its sidecar's upstream listener.
    discovery: str = flag(
        "consul",
        "how stages find each other: Consul; Consul Connect (consul-k8s injects an "
        "Envoy sidecar, which carries the gRPC hops); or the API server's EndpointSlices of "
        "each stage's headless Service (no Consul needed)",
        choices=["consul", "connect", "kubernetes"],
    )
    consul: str = flag(
        "consul-server.consul:8500", "Consul's HTTP API, where every stage registers (consul-k8s)"
    )
    shutdown_grace_s: int = flag(30, "seconds a stage drains on SIGTERM before it is killed")
    # The Secret of the stages' certificates (prism.ops.deploy.tls); "": plaintext between them.
    # Connect's sidecars bring their own mutual TLS.
    tls_secret: str = flag(
        "prism-tls",
        "Secret with tls.crt, tls.key and ca.crt: mutual TLS between the stages, the "
        "certificate naming NAME-mesh ('': plaintext; --discovery connect: the sidecars' "
        "mutual TLS instead)",
    )
    metrics_namespace: str = flag(
        "monitoring",
        "the namespace whose pods (Prometheus) may reach the stages' metrics ports",
    )
    routing: RoutingConfig = nested(RoutingConfig)
    service_monitor: bool = flag(
        False, "a ServiceMonitor (Prometheus Operator) that scrapes every stage's metrics"
    )
    # slo: a `prism planner` Deployment sets the replicas of the mode's roles.
    planner: PlannerConfig = nested(PlannerConfig)
    out: str = flag("-", "file to write (default: stdout)")
