"""The hardening every pod of a mesh gets, and the checks it answers (`make lint` runs
checkov on the manifests).

Every container runs as the image's unprivileged user (Dockerfile: UID 10001), may not
gain privileges, holds no capability (UCX over TCP needs none; its shared-memory copy
across processes, CMA, would need SYS_PTRACE, and RDMA would need IPC_LOCK: neither is
used between pods), runs under the runtime's default seccomp profile and has a
read-only root filesystem. What it writes goes to volumes: /tmp, and HOME, where the
image points every cache (Hugging Face, vLLM, torch, Triton). The namespace enforces
Kubernetes' `restricted` Pod Security Standard, which asks all of that (`baseline` under
Connect, whose injected containers are consul-k8s's own).
"""

from __future__ import annotations

from typing import Any

UID = 10001
HOME = "/home/prism"
TMP = "/tmp"


def pod_context() -> dict[str, Any]:
    # fsGroup: the group of the volumes' files, the TLS secret's key among them.
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip


def container_context() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}  # fmt: skip


def writable() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The mounts and volumes of what a container writes under a read-only root."""
    mounts = [{"name": "tmp", "mountPath": TMP}, {"name": "home", "mountPath": HOME}]
    volumes = [{"name": "tmp", "emptyDir": {}}, {"name": "home", "emptyDir": {}}]
    return mounts, volumes


def namespace(name: str, enforce: str = "restricted") -> dict[str, Any]:
    """The mesh's own namespace, which admits only pods that meet `enforce` (a Pod
    Security Standard) and warns of any below `restricted`."""
    labels = {f"pod-security.kubernetes.io/{mode}": level
              for mode, level in (("enforce", enforce), ("warn", "restricted"),
                                  ("audit", "restricted"))}  # fmt: skip
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def skips(image: str, token: str = "") -> dict[str, str]:
    """The annotations that tell checkov which checks a stage's Deployment does not meet,
    each with its reason, where it applies. `token`: why the pod mounts its
    service-account token, if it does."""
    fixed = ("the image is a fixed version tag or a digest, which never changes: a node may "
             "run one it holds (kind load, a cache)")  # fmt: skip
    checks = [("CKV_K8S_15", fixed)]
    if "@sha256:" not in image:
        tagged = ("the image is built from this checkout and tagged with its version; "
                  "--image takes REPO@sha256:DIGEST once it is pushed")  # fmt: skip
        checks.append(("CKV_K8S_43", tagged))
    if token:
        checks.append(("CKV_K8S_38", f"the token is mounted: {token}"))
    return {f"checkov.io/skip{i}": f"{check}={why}" for i, (check, why) in enumerate(checks, 1)}
