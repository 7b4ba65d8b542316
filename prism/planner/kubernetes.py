"""The planner's Kubernetes backend: each role's Deployment, `PREFIX-ROLE` as `prism deploy
kubernetes --name PREFIX` names it, read and scaled through its `scale` subresource, the
one thing the planner's Role allows (get and patch, on those Deployments alone).

Two requests over the standard library's urllib: a client library would be a large
dependency for them. Synchronous, as the planner's loop is.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import SplitResult

from prism.registry.kubernetes import ApiAccess, api_access, service_name

_SCALE = "/apis/apps/v1/namespaces/{namespace}/deployments/{name}/scale"
# Seconds a request may take: the loop decides again at its next interval.
_TIMEOUT_S = 10.0


class ScaleRefused(RuntimeError):
    """The API server refused to read or to scale a role's Deployment."""

    def __init__(self, deployment: str, status: int, message: str) -> None:
        super().__init__(f"deployment {deployment}: HTTP {status}: {message}")
        self.deployment = deployment
        self.status = status
        self.message = message


class KubernetesBackend:
    def __init__(self, access: ApiAccess) -> None:
        self.access = access
        self.ssl = access.ssl_context()

    @classmethod
    def from_url(cls, url: SplitResult) -> KubernetesBackend:
        return cls(api_access(url, "--backend"))

    def deployment(self, role: str) -> str:
        """The Deployment of `role`: named as its Service."""
        return service_name(self.access.prefix, role)

    def replicas(self, role: str) -> int:
        # The Scale's status: the pods the Deployment has now, not those it asks for.
        return int(self._scale(role).get("status", {}).get("replicas", 0))

    def scale(self, role: str, count: int) -> None:
        self._scale(role, {"spec": {"replicas": count}})

    def _scale(self, role: str, patch: dict[str, Any] | None = None) -> dict[str, Any]:
        """GETs the Scale of `role`'s Deployment, or PATCHes it with `patch`."""
        name = self.deployment(role)
        access = self.access
        url = access.api.rstrip("/") + _SCALE.format(namespace=access.namespace, name=name)
        headers = {"Accept": "application/json", **access.headers()}
        data = None
        if patch is not None:
            data = json.dumps(patch).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        request = urllib.request.Request(
            url, data, headers, method="GET" if patch is None else "PATCH"
        )
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S, context=self.ssl) as reply:
                return json.load(reply)
        except urllib.error.HTTPError as exc:
            raise ScaleRefused(name, exc.code, _message(exc)) from None


def _message(error: urllib.error.HTTPError) -> str:
    """The `message` of the API server's Status, or the reply as it came."""
    text = error.read().decode(errors="replace")
    try:
        return json.loads(text)["message"]
    except (ValueError, KeyError, TypeError):
        return text.strip() or str(error.reason)
