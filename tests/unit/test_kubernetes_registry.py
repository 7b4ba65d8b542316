"""The Kubernetes registry backend against a fake API server on loopback that speaks the
real Kubernetes JSON: EndpointSlice lists, and watches of ADDED, MODIFIED, DELETED,
BOOKMARK and ERROR events."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from prism.registry import open_registry
from prism.registry.kubernetes import KubernetesRegistry, ready_addresses

NAMESPACE = "mesh"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"


def endpoint_slice(name: str, service: str, pods: dict[str, bool], port: int = 50051) -> dict:
    """An EndpointSlice as the controller writes it; `pods`: address → ready."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready, "serving": ready, "terminating": not ready},
                "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": f"pod-{i}"},
            }
            for i, (address, ready) in enumerate(pods.items())
        ],
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
    }


class ApiServer:
    """The EndpointSlices of one namespace, listed and watched as the API server does."""

    def __init__(self) -> None:
        self.version = 1
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, dict]] = []
        self.changed = asyncio.Condition()
        self.requests: list[dict[str, str]] = []

    async def change(self, kind: str, item: dict) -> None:
        async with self.changed:
            self.version += 1
            item = json.loads(json.dumps(item))
            item["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.slices.pop(item["metadata"]["name"], None)
            elif kind != "ERROR":
                self.slices[item["metadata"]["name"]] = item
            self.events.append((self.version, {"type": kind, "object": item}))
            self.changed.notify_all()

    async def expire_watches(self) -> None:
        status = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "too old resource version",
            "reason": "Expired",
            "code": 410,
        }
        await self.change("ERROR", status)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        key, _, service = query["labelSelector"].partition("=")
        assert key == "kubernetes.io/service-name"

        def selected(item: dict) -> bool:
            labels = item["metadata"].get("labels", {})
            return item.get("kind") == "Status" or labels.get(key) == service

        if query.get("watch") != "1":
            items = [s for s in self.slices.values() if selected(s)]
            return web.json_response({"kind": "EndpointSliceList", "apiVersion":
                                      "discovery.k8s.io/v1", "metadata": {"resourceVersion":
                                      str(self.version)}, "items": items})  # fmt: skip
        reply = web.StreamResponse()
        reply.content_type = "application/json"
        await reply.prepare(request)
        sent = int(query["resourceVersion"])
        while True:
            async with self.changed:
                await self.changed.wait_for(
                    lambda sent=sent: bool(self.events) and self.events[-1][0] > sent
                )
                new = [(v, e) for v, e in self.events if v > sent]
            for version, event in new:
                sent = version
                if selected(event["object"]):
                    await reply.write(json.dumps(event).encode() + b"\n")
                if event["type"] == "ERROR":
                    return reply


@contextlib.asynccontextmanager
async def api_server():
    api = ApiServer()
    app = web.Application()
    app.router.add_get(PATH, api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield api, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate()


def test_replicas_come_and_go_as_the_endpoint_slices_change():
    async def main() -> None:
        async with api_server() as (api, url):
            await api.change(
                "ADDED",
                endpoint_slice(
                    "mesh-decode-a", "mesh-decode", {"192.0.2.1": True, "192.0.2.2": False}
                ),
            )
            await api.change("ADDED", endpoint_slice(
                "mesh-prefill-a", "mesh-prefill", {"192.0.2.9": True}))  # fmt: skip
            registry = KubernetesRegistry(url, "mesh", NAMESPACE)
            try:
                await registry.watch("decode", ["model=m", "mode=e/p/d"])
                # Only the ready pods of the role's own Service.
                await until(lambda: registry.endpoints("decode") == ["192.0.2.1:50051"])
                assert registry.endpoints("prefill") == []
                # A replica becomes ready; a second slice of the Service adds another.
                await api.change(
                    "MODIFIED",
                    endpoint_slice(
                        "mesh-decode-a", "mesh-decode", {"192.0.2.1": True, "192.0.2.2": True}
                    ),
                )
                await api.change("ADDED", endpoint_slice(
                    "mesh-decode-b", "mesh-decode", {"192.0.2.3": True}))  # fmt: skip
                await until(lambda: registry.endpoints("decode") == [
                    "192.0.2.1:50051", "192.0.2.2:50051", "192.0.2.3:50051"])  # fmt: skip
                # One drains (its readiness fails), and a whole slice goes.
                await api.change(
                    "MODIFIED",
                    endpoint_slice(
                        "mesh-decode-a", "mesh-decode", {"192.0.2.1": False, "192.0.2.2": True}
                    ),
                )
                await api.change("DELETED", endpoint_slice("mesh-decode-b", "mesh-decode", {}))
                await until(lambda: registry.endpoints("decode") == ["192.0.2.2:50051"])
            finally:
                await registry.close()
            first, *_ = api.requests
            assert first == {"labelSelector": "kubernetes.io/service-name=mesh-decode"}

    asyncio.run(main())


def test_an_expired_watch_starts_again_from_a_fresh_list():
    async def main() -> None:
        async with api_server() as (api, url):
            await api.change("ADDED", endpoint_slice("mesh-worker-a", "mesh-worker",
                                                     {"192.0.2.1": True}))  # fmt: skip
            registry = KubernetesRegistry(url, "mesh", NAMESPACE)
            try:
                await registry.watch("worker")
                await until(lambda: registry.endpoints("worker") == ["192.0.2.1:50051"])
                await api.expire_watches()
                # Changed while no watch ran: only a new list can tell.
                api.slices["mesh-worker-a"] = endpoint_slice(
                    "mesh-worker-a", "mesh-worker", {"192.0.2.4": True}
                )
                await until(lambda: registry.endpoints("worker") == ["192.0.2.4:50051"])
                lists = [r for r in api.requests if "watch" not in r]
                assert len(lists) >= 2
            finally:
                await registry.close()

    asyncio.run(main())


def test_a_condition_left_unset_counts_as_ready_and_ipv6_is_bracketed():
    item = endpoint_slice("s", "svc", {"2001:db8::1": True}, port=8000)
    del item["endpoints"][0]["conditions"]
    assert ready_addresses(item) == ["[2001:db8::1]:8000"]
    assert ready_addresses({"endpoints": None, "ports": None}) == []


def registry_flag(value: str) -> argparse.Namespace:
    return argparse.Namespace(registry=value)


def test_the_registry_flag_names_the_api_prefix_and_namespace():
    registry = open_registry(registry_flag("kubernetes+http://127.0.0.1:8001/mesh?namespace=ns"))
    assert isinstance(registry, KubernetesRegistry)
    assert (registry.api, registry.prefix, registry.namespace) == (
        "http://127.0.0.1:8001", "mesh", "ns")  # fmt: skip
    with pytest.raises(ValueError, match="in a pod with a service account"):
        KubernetesRegistry.from_url(urlsplit("kubernetes:///mesh"))
    with pytest.raises(ValueError, match="takes no host"):
        KubernetesRegistry.from_url(urlsplit("kubernetes://example/mesh"))
