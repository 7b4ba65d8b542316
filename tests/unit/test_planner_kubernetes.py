"""The planner's Kubernetes backend against a fake API server on loopback
(tests/support/kube_api.py) that serves Deployments' `scale` subresource and authorizes
every request as RBAC does, with the rules of the Role that `prism deploy kubernetes
--planner slo` gives the planner: it may read and set the replicas of the roles it
scales, and do nothing else."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import certifi
import pytest
from support.kube_api import MERGE_PATCH, KubeApi

from prism.config.deploy import KubernetesConfig
from prism.config.planner import PlannerConfig
from prism.modes import MODES
from prism.ops.deploy.kubernetes import manifests
from prism.planner import open_backend
from prism.planner.kubernetes import KubernetesBackend, ScaleRefused
from prism.registry import kubernetes as registry
from prism.registry.kubernetes import ApiAccess

TOKEN = "planner-token"
USER = "system:serviceaccount:mesh:mesh-planner"
EVERY_STAGE = ("encoder", "worker", "prefill", "decode", "processor", "gateway")
SCALE = "/apis/apps/v1/namespaces/mesh/deployments/{}/scale"


def planner_rules(mode: str) -> list[dict[str, Any]]:
    """The rules of the planner's Role in the manifests of `mode`."""
    settings = KubernetesConfig(mode=mode, model="m", name="mesh", namespace="mesh",
                                planner=PlannerConfig(planner="slo"))  # fmt: skip
    (role,) = [o for o in manifests(settings) if o["kind"] == "Role"]
    assert role["metadata"]["name"] == "mesh-planner"
    return role["rules"]


@contextmanager
def cluster(mode: str = "e/p/d") -> Iterator[KubeApi]:
    """A Deployment of every stage there is, one replica each; the planner's token bound
    to its Role."""
    with KubeApi(namespace="mesh") as api:
        for stage in EVERY_STAGE:
            api.put_deployment(f"mesh-{stage}")
        api.grant(TOKEN, planner_rules(mode), user=USER)
        yield api


def planner(api: KubeApi, token: str = TOKEN) -> KubernetesBackend:
    return KubernetesBackend(ApiAccess(api.url, "mesh", "mesh", token=token))


def call(
    api: KubeApi,
    method: str,
    path: str,
    body: Any = None,
    token: str = TOKEN,
    content_type: str = MERGE_PATCH,
) -> tuple[int, dict[str, Any]]:
    """One request as the planner's token makes it: the status and the JSON answered."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = content_type
    request = urllib.request.Request(api.url + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_the_planner_reads_and_sets_the_replicas_of_a_role():
    with cluster() as api:
        backend = planner(api)
        assert [backend.replicas(role) for role in ("encoder", "prefill", "decode")] == [1, 1, 1]
        backend.scale("encoder", 3)
        assert backend.replicas("encoder") == 3
        assert api.deployments["mesh-encoder"]["spec"]["replicas"] == 3
        # Down to none: the Scale then leaves its spec's replicas out, as the API does.
        backend.scale("decode", 0)
        assert backend.replicas("decode") == 0
        status, scale = call(api, "GET", SCALE.format("mesh-decode"))
        assert status == 200 and scale["spec"] == {} and scale["status"]["replicas"] == 0
        assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")


@pytest.mark.parametrize("mode", MODES)
def test_its_role_lets_it_scale_the_modes_roles_and_no_other_stage(mode):
    roles = {str(role) for role in MODES[mode].roles}
    with cluster(mode) as api:
        backend = planner(api)
        for stage in EVERY_STAGE:
            if stage in roles:
                backend.scale(stage, 2)
                assert backend.replicas(stage) == 2
                continue
            with pytest.raises(ScaleRefused) as refused:
                backend.scale(stage, 2)
            assert (refused.value.status, refused.value.deployment) == (403, f"mesh-{stage}")
            with pytest.raises(ScaleRefused, match="403"):
                backend.replicas(stage)
            assert api.deployments[f"mesh-{stage}"]["spec"]["replicas"] == 1


def test_a_refusal_names_the_deployment_and_says_why_as_the_api_server_does():
    with cluster() as api, pytest.raises(ScaleRefused) as refused:
        planner(api).scale("processor", 2)
    assert str(refused.value) == (
        'deployment mesh-processor: HTTP 403: deployments.apps "mesh-processor" is forbidden: '
        f'User "{USER}" cannot patch resource "deployments/scale" in API group "apps" in the '
        'namespace "mesh"'
    )


def test_its_token_may_not_touch_a_deployment_itself_nor_anything_else():
    encoder = "/apis/apps/v1/namespaces/mesh/deployments/mesh-encoder"
    with cluster() as api:
        # The Deployment itself (its pod template: the image, the command) is not its to
        # change, nor to read; nor may it update the Scale it may patch.
        status, body = call(api, "PATCH", encoder, {"spec": {"replicas": 5}})
        assert (status, body["reason"]) == (403, "Forbidden")
        assert body["message"] == (
            f'deployments.apps "mesh-encoder" is forbidden: User "{USER}" cannot patch '
            'resource "deployments" in API group "apps" in the namespace "mesh"'
        )
        assert call(api, "GET", encoder)[0] == 403
        assert call(api, "PUT", encoder + "/scale", {"spec": {"replicas": 5}})[0] == 403
        # Pods, Secrets, Deployments as a list, EndpointSlices: nothing else either.
        status, body = call(api, "GET", "/api/v1/namespaces/mesh/pods")
        assert status == 403 and body["message"] == (
            f'pods is forbidden: User "{USER}" cannot list resource "pods" in API group "" '
            'in the namespace "mesh"'
        )
        for path in ("/api/v1/namespaces/mesh/secrets/prism-tls",
                     "/apis/apps/v1/namespaces/mesh/deployments",
                     "/apis/discovery.k8s.io/v1/namespaces/mesh/endpointslices"):  # fmt: skip
            assert call(api, "GET", path)[0] == 403, path
        assert api.deployments["mesh-encoder"]["spec"]["replicas"] == 1


def test_without_a_token_it_knows_the_api_server_does_not_know_it():
    with cluster() as api:
        assert call(api, "GET", SCALE.format("mesh-encoder"), token="")[0] == 401
        with pytest.raises(ScaleRefused, match="HTTP 401: Unauthorized"):
            planner(api, token="another").replicas("encoder")


def test_a_pods_token_is_read_again_for_every_request(tmp_path):
    # The kubelet rotates a projected service-account token in its file.
    token = tmp_path / "token"
    token.write_text("expired\n")
    with cluster() as api:
        backend = KubernetesBackend(ApiAccess(api.url, "mesh", "mesh", token_file=str(token)))
        with pytest.raises(ScaleRefused, match="HTTP 401"):
            backend.replicas("encoder")
        token.write_text(f"{TOKEN}\n")
        assert backend.replicas("encoder") == 1


def test_a_deployment_that_is_not_there_is_a_404_naming_it():
    with cluster() as api:
        del api.deployments["mesh-decode"]
        with pytest.raises(ScaleRefused) as refused:
            planner(api).replicas("decode")
    assert refused.value.status == 404
    assert refused.value.message == 'deployments.apps "mesh-decode" not found'


def test_a_scale_is_a_merge_patch_of_a_count():
    with cluster() as api:
        path = SCALE.format("mesh-encoder")
        plain = call(api, "PATCH", path, {"spec": {"replicas": 2}}, content_type="application/json")
        assert (plain[0], plain[1]["reason"]) == (415, "UnsupportedMediaType")
        assert call(api, "PATCH", path, {"spec": {"replicas": -1}})[0] == 422
        assert api.deployments["mesh-encoder"]["spec"]["replicas"] == 1


def test_the_backend_url_names_the_api_prefix_and_namespace(monkeypatch):
    backend = open_backend("kubernetes+http://127.0.0.1:8001/mesh?namespace=ns")
    assert isinstance(backend, KubernetesBackend)
    assert backend.access == ApiAccess("http://127.0.0.1:8001", "mesh", "ns")
    assert open_backend("kubernetes+http://127.0.0.1:8001").access.namespace == "default"
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="--backend kubernetes:///PREFIX works in a pod"):
        KubernetesBackend.from_url(urlsplit("kubernetes:///mesh"))
    with pytest.raises(ValueError, match="takes no host"):
        KubernetesBackend.from_url(urlsplit("kubernetes://example/mesh"))
    with pytest.raises(ValueError, match="--backend must be"):
        open_backend("http://127.0.0.1:8001/mesh")


def test_in_a_pod_the_service_account_gives_the_api_server_token_and_namespace(
    monkeypatch, tmp_path
):
    (tmp_path / "token").write_text("the-token\n")
    (tmp_path / "namespace").write_text("inference\n")
    shutil.copy(certifi.where(), tmp_path / "ca.crt")
    monkeypatch.setattr(registry, "ACCOUNT", tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    backend = open_backend("kubernetes:///mesh")
    assert backend.access == ApiAccess("https://[fd00::1]:6443", "mesh", "inference",
                                       ca_file=str(tmp_path / "ca.crt"),
                                       token_file=str(tmp_path / "token"))  # fmt: skip
    assert backend.ssl is not None
    assert open_backend("kubernetes:///mesh?namespace=other").access.namespace == "other"
