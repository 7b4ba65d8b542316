"""Mutual TLS between the stages of a mesh (`--tls-secret`, on by default): a pod that is
not a stage holds no certificate the stages' CA signed, so it cannot call one, whatever
the network lets through.

Every stage, the gateway as a client of the processor included, mounts one Secret in the
shape cert-manager writes and `kubectl create secret tls` takes plus the CA:
`tls.crt` and `tls.key` (a certificate for both server and client authentication, whose
subject alternative names include `server_name`) and `ca.crt` (the CA that signed it).
Stages dial each other by pod IP, so each checks the name `server_name` in its peer's
certificate instead of the address. The gateway's HTTP door stays plaintext, behind
whatever ingress terminates TLS.

Kubelet's gRPC probes and Consul's checks cannot present a client certificate: each
gRPC stage also serves its health alone, in plaintext, on `HEALTH_PORT`, which readiness
probes and Consul check. With Consul Connect the sidecars' mutual TLS carries the gRPC
hops instead, and this is off.
"""

from __future__ import annotations

from typing import Any

from prism.config.common import MetricsConfig, TlsConfig
from prism.ops.deploy.ports import HEALTH_PORT

MOUNT = "/etc/prism/tls"


def server_name(mesh: str) -> str:
    """The name each stage expects in its peers' certificates."""
    return f"{mesh}-mesh"


def args(mesh: str, kind: str) -> list[str]:
    """The TLS flags of stage `kind` of the mesh named `mesh`."""
    files = TlsConfig(f"{MOUNT}/tls.crt", f"{MOUNT}/tls.key", f"{MOUNT}/ca.crt", server_name(mesh))
    if kind == "gateway":  # the gateway's /health is HTTP, outside TLS
        return files.to_argv()
    return [*files.to_argv(), *MetricsConfig(health_port=HEALTH_PORT).to_argv()]


def volume(secret: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The mount and volume of the Secret: read-only, the key readable by the pod's
    group (its fsGroup) alone."""
    mount = {"name": "tls", "mountPath": MOUNT, "readOnly": True}
    return mount, {"name": "tls", "secret": {"secretName": secret, "defaultMode": 0o440}}
