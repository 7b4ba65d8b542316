"""A mesh that finds its stages as Kubernetes does (`--registry kubernetes+http://...`):
real gateway, processor and simulated workers, each following the EndpointSlices of its
peers' Services through a fake API server (tests/support/kube_api.py). Replicas the slices add
get requests; replicas they drop, or mark not ready, get none."""

from __future__ import annotations

import itertools

import httpx
import pytest
from support.kube_api import KubeApi, endpoint_slice
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.config.registry import RegistryConfig

LONG = " ".join(f"word{i}" for i in range(60))
# A new prompt for each check: none is cached anywhere yet.
prompts = itertools.count(1)


def split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def publish(api: KubeApi, stages, ready: dict[str, bool]) -> None:
    """One slice per stage replica (each listens on a port of its own here)."""
    for stage in stages:
        if stage.name == "gateway":
            continue
        role = stage.name.rsplit("-", 1)[0] if stage.name[-1].isdigit() else stage.name
        host, port = split(stage.address)
        api.put(endpoint_slice(f"mesh-{stage.name}", f"mesh-{role}",
                               {host: ready.get(stage.name, True)}, port))  # fmt: skip


def cached_again(base_url: str, model: str, n: int) -> bool:
    """Whether prompt `n`, sent twice, found its start cached the second time: with
    round-robin over two live workers it goes to the other one, and finds nothing."""
    body = {"model": model, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"Question {n}: {LONG}"}]}  # fmt: skip
    cached = []
    for _ in range(2):
        reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0
    return cached[1] > 0


@pytest.fixture(scope="module")
def kube_mesh(models, tmp_path_factory):
    with KubeApi(namespace="mesh") as api:
        planned = []

        def place(stages) -> None:
            planned.extend(stages)
            publish(api, stages, {})

        registry = RegistryConfig(
            f"kubernetes+http://127.0.0.1:{split(api.url)[1]}/mesh?namespace=mesh"
        )
        mesh = start_mesh("llava", "epd", models["llava"], tmp_path_factory.mktemp("kube"),
                          place=place, workers=2, engine="sim", registry=registry,
                          front="split")  # fmt: skip
        try:
            yield api, mesh, planned
        finally:
            mesh.stop()


def test_stages_find_each_other_and_follow_the_slices(kube_mesh):
    api, mesh, stages = kube_mesh
    # Gateway → processor → both workers, all found through the API server (apart, as
    # the manifests deploy them).
    assert not cached_again(mesh.base_url, mesh.model, 0)
    # worker-1 drains: its readiness fails, and the slice says so.
    publish(api, stages, {"worker-1": False})
    assert wait_for(lambda: cached_again(mesh.base_url, mesh.model, next(prompts)), 15)
    # Back: requests alternate again.
    publish(api, stages, {})
    assert wait_for(lambda: not cached_again(mesh.base_url, mesh.model, next(prompts)), 15)
    # No worker listed at all: a clear 503, and the mesh serves again once they return.
    for name in ("mesh-worker-0", "mesh-worker-1"):
        api.delete(name)
    body = {"model": mesh.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    assert wait_for(lambda: httpx.post(f"{mesh.base_url}/chat/completions", json=body,
                                       timeout=60).status_code == 503, 15)  # fmt: skip
    publish(api, stages, {})
    assert wait_for(lambda: httpx.post(f"{mesh.base_url}/chat/completions", json=body,
                                       timeout=60).status_code == 200, 15)  # fmt: skip
    # Every stage listed and watched through the API server, by its Service's label.
    selectors = {r["labelSelector"] for r in api.requests}
    assert selectors == {"kubernetes.io/service-name=mesh-processor",
                         "kubernetes.io/service-name=mesh-worker"}  # fmt: skip
