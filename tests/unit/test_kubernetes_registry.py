"""The Kubernetes registry backend against a fake API server on loopback
(tests/support/kube_api.py) that speaks the real Kubernetes JSON: EndpointSlice lists, and
chunked watches of ADDED, MODIFIED, DELETED and ERROR events."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest
from support.kube_api import KubeApi, endpoint_slice

from prism.config.registry import RegistryConfig
from prism.registry import open_registry
from prism.registry.kubernetes import ApiAccess, KubernetesRegistry, ready_addresses


async def until(predicate, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate()


def test_replicas_come_and_go_as_the_endpoint_slices_change():
    async def main(api: KubeApi) -> None:
        api.put(
            endpoint_slice("mesh-decode-a", "mesh-decode", {"192.0.2.1": True, "192.0.2.2": False})
        )
        api.put(endpoint_slice("mesh-prefill-a", "mesh-prefill", {"192.0.2.9": True}))  # fmt: skip
        registry = KubernetesRegistry(ApiAccess(api.url, "mesh", "mesh"))
        try:
            await registry.watch("decode", ["model=m", "mode=e/p/d"])
            # Only the ready pods of the role's own Service.
            await until(lambda: registry.endpoints("decode") == ["192.0.2.1:50051"])
            assert registry.endpoints("prefill") == []
            # A replica becomes ready; a second slice of the Service adds another.
            api.put(
                endpoint_slice(
                    "mesh-decode-a", "mesh-decode", {"192.0.2.1": True, "192.0.2.2": True}
                )
            )
            api.put(endpoint_slice("mesh-decode-b", "mesh-decode", {"192.0.2.3": True}))
            await until(
                lambda: (
                    registry.endpoints("decode")
                    == ["192.0.2.1:50051", "192.0.2.2:50051", "192.0.2.3:50051"]
                )
            )
            # One drains (its readiness fails), and a whole slice goes.
            api.put(
                endpoint_slice(
                    "mesh-decode-a", "mesh-decode", {"192.0.2.1": False, "192.0.2.2": True}
                )
            )
            api.delete("mesh-decode-b")  # fmt: skip
            await until(lambda: registry.endpoints("decode") == ["192.0.2.2:50051"])
        finally:
            await registry.close()
        listed, watched, *_ = api.requests
        assert listed == {"labelSelector": "kubernetes.io/service-name=mesh-decode"}
        assert watched["watch"] == "1" and watched["resourceVersion"] == "3"

    with KubeApi() as api:
        asyncio.run(main(api))


def test_an_expired_watch_starts_again_from_a_fresh_list():
    async def main(api: KubeApi) -> None:
        api.put(endpoint_slice("mesh-worker-a", "mesh-worker", {"192.0.2.1": True}))
        registry = KubernetesRegistry(ApiAccess(api.url, "mesh", "mesh"))
        try:
            await registry.watch("worker")
            await until(lambda: registry.endpoints("worker") == ["192.0.2.1:50051"])
            # Changed while no watch sees it (the registry has to list again to know).
            api.slices["mesh-worker-a"] = endpoint_slice("mesh-worker-a", "mesh-worker",
                                                         {"192.0.2.4": True})  # fmt: skip
            api.expire_watches()
            await until(lambda: registry.endpoints("worker") == ["192.0.2.4:50051"])
            assert len([r for r in api.requests if "watch" not in r]) == 2
        finally:
            await registry.close()

    with KubeApi() as api:
        asyncio.run(main(api))


def test_a_condition_left_unset_counts_as_ready_and_ipv6_is_bracketed():
    item = endpoint_slice("s", "svc", {"2001:db8::1": True}, port=8000)
    del item["endpoints"][0]["conditions"]
    assert ready_addresses(item) == ["[2001:db8::1]:8000"]
    assert ready_addresses({"endpoints": None, "ports": None}) == []


def test_the_registry_flag_names_the_api_prefix_and_namespace():
    registry = open_registry(RegistryConfig("kubernetes+http://127.0.0.1:8001/mesh?namespace=ns"))
    assert isinstance(registry, KubernetesRegistry)
    assert registry.access == ApiAccess("http://127.0.0.1:8001", "mesh", "ns")
    with pytest.raises(ValueError, match="in a pod with a service account"):
        KubernetesRegistry.from_url(urlsplit("kubernetes:///mesh"))
    with pytest.raises(ValueError, match="takes no host"):
        KubernetesRegistry.from_url(urlsplit("kubernetes://example/mesh"))
