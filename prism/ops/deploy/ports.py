"""The ports of a mesh's pods, and which stages run engines: what the Deployments, the
Services and the NetworkPolicies must agree on."""

from __future__ import annotations

# Container ports: the stages' own defaults (prism worker --help, ...), one per stage.
PORTS = {"gateway": 8000, "processor": 50050, "encoder": 50052}
ENGINE_PORT = 50051
METRICS_PORT = 9100
# vLLM's NIXL side channel (ZMQ), where decode fetches a prefill engine's metadata.
KV_PORT = 5600
# grpc.health.v1 in plaintext under mutual TLS (`--health-port`), for probes and Consul.
HEALTH_PORT = 8081
# The listeners of UCX's TCP transport (UCX_TCP_PORT_RANGE): NIXL readers dial the
# owner's. A hundred leaves room for every agent of a pod (Prism's, vLLM's per rank),
# each listening on every interface.
UCX_PORTS = (5700, 5799)
# The public listener of the Envoy sidecar consul-k8s injects (Connect): callers' sidecars
# dial it, and it hands the call to the stage on 127.0.0.1.
CONNECT_INBOUND_PORT = 20000

# The stages that run a vLLM engine.
ENGINES = ("worker", "prefill", "decode")


def port(kind: str) -> int:
    """The port stage `kind` serves on."""
    return PORTS.get(kind, ENGINE_PORT)
