"""The Kubernetes registry backend: a cluster without Consul.

Each stage of a mesh has a headless Service (`prism deploy kubernetes --discovery
kubernetes` writes them), and Kubernetes lists its ready pods in the Service's
EndpointSlices. Discovery follows those slices through the API server (list, then watch
from the list's resourceVersion; again from a fresh list when the watch expires).
Registration is the pod's readiness: a stage that reports NOT_SERVING on its gRPC health
(on drain, or before it is ready) fails its readiness probe and leaves the slices, so
`register` and `deregister` have nothing to do.

The client is a list and a watch of one resource over aiohttp (already a dependency):
the official client is synchronous, and an asyncio port of it is a large dependency for
two requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import SplitResult

import aiohttp

from prism.registry import Instance

log = logging.getLogger(__name__)

# Where a pod finds its service account (Kubernetes mounts it there).
ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_SLICES = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
# Seconds one watch runs before the API server ends it and it starts again.
_WATCH_S = 300


def service_name(prefix: str, role: str) -> str:
    """The headless Service of `role` in the mesh named `prefix`."""
    return f"{prefix}-{role}"


def ready_addresses(slice_: dict[str, Any]) -> list[str]:
    """HOST:PORT of each ready endpoint of one EndpointSlice, on its first port."""
    ports = slice_.get("ports") or []
    if not ports or ports[0].get("port") is None:
        return []
    port = ports[0]["port"]
    out = []
    for endpoint in slice_.get("endpoints") or []:
        # As kube-proxy reads it: a condition left unset counts as ready.
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for host in endpoint.get("addresses", [])[:1]:
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return out


class ApiAccess(NamedTuple):
    """Where the API server is and how to call it, for the mesh named `prefix`."""

    api: str
    prefix: str
    namespace: str
    token: str = ""
    ca_file: str = ""
    # A pod's: read again for every request.
    token_file: str = ""

    def headers(self) -> dict[str, str]:
        """The Authorization header: the token, or the one in `token_file` as it is now
        (the kubelet rotates a projected service-account token in its file; client-go
        reads it again likewise)."""
        token = Path(self.token_file).read_text().strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        """The cluster's own CA, which signs the API server's certificate, if given."""
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None


def api_access(url: SplitResult, option: str) -> ApiAccess:
    """`kubernetes:///PREFIX` in a pod: the API server, token and namespace its service
    account gives; `kubernetes+http://HOST:PORT/PREFIX` through `kubectl proxy` (which
    adds the credentials). `?namespace=NS` names another namespace. `option`: the flag
    that gave `url`, for the errors."""
    prefix = url.path.strip("/") or "prism"
    query = dict(part.partition("=")[::2] for part in url.query.split("&") if part)
    if url.scheme == "kubernetes+http":
        return ApiAccess(f"http://{url.netloc}", prefix, query.get("namespace", "default"))
    if url.netloc:
        raise ValueError("kubernetes:///PREFIX takes no host: in a pod the API server is "
                         "the one the service account names")  # fmt: skip
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host or not ACCOUNT.is_dir():
        raise ValueError(f"{option} kubernetes:///PREFIX works in a pod with a service "
                         "account; elsewhere use kubernetes+http://HOST:PORT/PREFIX "
                         "(kubectl proxy)")  # fmt: skip
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    return ApiAccess(
        f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
        prefix,
        query.get("namespace") or (ACCOUNT / "namespace").read_text().strip(),
        ca_file=str(ACCOUNT / "ca.crt"),
        token_file=str(ACCOUNT / "token"),
    )


class KubernetesRegistry:
    def __init__(self, access: ApiAccess, watch_s: int = _WATCH_S) -> None:
        self.access = access
        self.ssl: ssl.SSLContext | bool = access.ssl_context() or True
        self.watch_s = watch_s
        self._session: aiohttp.ClientSession | None = None
        # Role → slice name → its ready addresses.
        self._slices: dict[str, dict[str, list[str]]] = {}
        self._watches: dict[str, asyncio.Task] = {}

    @classmethod
    def from_url(cls, url: SplitResult) -> KubernetesRegistry:
        return cls(api_access(url, "--registry"))

    @property
    def _client(self) -> aiohttp.ClientSession:
        # Made on first use: it needs the running event loop.
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def endpoints(self, role: str) -> list[str]:
        slices = self._slices.get(role, {})
        return [address for name in sorted(slices) for address in slices[name]]

    async def watch(self, role: str, tags: Sequence[str] = ()) -> None:
        # The mesh's own Service is the selection: its pods serve one model in one mode.
        if role not in self._watches:
            self._watches[role] = asyncio.create_task(self._follow(role))

    async def _follow(self, role: str) -> None:
        access = self.access
        url = access.api.rstrip("/") + _SLICES.format(namespace=access.namespace)
        selector = f"kubernetes.io/service-name={service_name(access.prefix, role)}"
        pause = 0.5
        while True:
            try:
                version = await self._list(role, url, selector)
                pause = 0.5
                await self._watch(role, url, selector, version)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is away, or the watch expired
                log.warning("kubernetes: cannot follow %s: %s", role, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 10.0)

    async def _list(self, role: str, url: str, selector: str) -> str:
        headers = self.access.headers()
        params = {"labelSelector": selector}
        async with self._client.get(url, params=params, headers=headers, ssl=self.ssl) as reply:
            reply.raise_for_status()
            listed = await reply.json()
        self._set(role, {item["metadata"]["name"]: ready_addresses(item)
                         for item in listed.get("items") or []})  # fmt: skip
        return listed["metadata"]["resourceVersion"]

    async def _watch(self, role: str, url: str, selector: str, version: str) -> None:
        params = {"labelSelector": selector, "watch": "1", "resourceVersion": version,
                  "allowWatchBookmarks": "true", "timeoutSeconds": str(self.watch_s)}  # fmt: skip
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.watch_s + 30)
        headers = self.access.headers()
        async with self._client.get(
            url, params=params, headers=headers, ssl=self.ssl, timeout=timeout
        ) as reply:
            reply.raise_for_status()
            async for line in reply.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, item = event["type"], event["object"]
                if kind == "ERROR":
                    # e.g. 410 Gone: the version is too old; a fresh list starts again.
                    raise RuntimeError(f"watch error: {item.get('message', item)}")
                if kind == "BOOKMARK":
                    continue
                slices = dict(self._slices.get(role, {}))
                name = item["metadata"]["name"]
                if kind == "DELETED":
                    slices.pop(name, None)
                else:
                    slices[name] = ready_addresses(item)
                self._set(role, slices)

    def _set(self, role: str, slices: dict[str, list[str]]) -> None:
        before = self.endpoints(role)
        self._slices[role] = slices
        if self.endpoints(role) != before:
            log.info("kubernetes: %s now %s", role, self.endpoints(role) or "none")

    async def register(self, instance: Instance) -> None:
        pass  # the pod's readiness registers it

    async def deregister(self) -> None:
        pass  # NOT_SERVING fails the readiness probe: the pod leaves the slices

    async def close(self) -> None:
        for task in self._watches.values():
            task.cancel()
        await asyncio.gather(*self._watches.values(), return_exceptions=True)
        self._watches.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None
