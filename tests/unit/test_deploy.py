"""`prism deploy kubernetes`: each mode's manifests have exactly the stages the mode needs,
wired as `prism serve` wires them, probed on the ports they serve, hardened (non-root,
read-only, no capabilities, bounded, their own namespace), each stage reachable only by
the stages that call it and, between stages, only with a certificate of the mesh. With
the planner, one more pod sets the replicas of the mode's roles, allowed by its Role to do
that and nothing else."""

from __future__ import annotations

import argparse

import pytest

from prism.cli import build_parser
from prism.config.deploy import KubernetesConfig
from prism.config.planner import PlannerConfig, PlannerStageConfig
from prism.modes import MODES
from prism.ops.deploy import kubernetes, security
from prism.ops.deploy.kubernetes import manifests
from prism.ops.deploy.ports import (
    CONNECT_INBOUND_PORT,
    HEALTH_PORT,
    KV_PORT,
    METRICS_PORT,
    UCX_PORTS,
)

DISCOVERY = ("consul", "kubernetes", "connect")

STAGES = {
    "epd": {"worker", "processor", "gateway"},
    "e/pd": {"encoder", "worker", "processor", "gateway"},
    "e/p/d": {"encoder", "prefill", "decode", "processor", "gateway"},
    "ep/d": {"prefill", "decode", "processor", "gateway"},
}
# The stages the planner scales, in the mode's order.
SCALED = {"epd": ["worker"], "e/pd": ["encoder", "worker"],
          "e/p/d": ["encoder", "prefill", "decode"], "ep/d": ["prefill", "decode"]}  # fmt: skip
SLO = PlannerConfig(planner="slo")


def deployments(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o
            for o in objects if o["kind"] == "Deployment"}  # fmt: skip


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def pod(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def settings(mode: str, **given) -> KubernetesConfig:
    return KubernetesConfig(mode=mode, model="/models/tiny-llava", tiny_model="llava", **given)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_has_exactly_its_stages_each_with_a_service_and_a_budget(mode):
    objects = manifests(settings(mode))
    assert set(deployments(objects)) == STAGES[mode]
    for kind in ("Service", "PodDisruptionBudget"):
        named = {o["metadata"]["name"] for o in objects if o["kind"] == kind}
        assert named == {f"prism-{stage}" for stage in STAGES[mode]}
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]


@pytest.mark.parametrize("mode", MODES)
def test_every_container_runs_a_valid_prism_command_found_through_consul(mode):
    for stage, deployment in deployments(manifests(settings(mode))).items():
        args = container(deployment)["args"]
        parsed = build_parser().parse_args(args)
        assert parsed.command == ("worker" if stage in ("prefill", "decode") else stage)
        assert parsed.registry == "consul://consul-server.consul:8500"
        assert parsed.host == "0.0.0.0" and parsed.advertise_host == "$(POD_IP)"
        # Nothing of the machine that wrote the manifests: no loopback peers or ports.
        assert "--peer" not in args and not any("127.0.0.1" in a for a in args)
        if stage == "processor":
            assert parsed.mode == mode


def test_roles_and_the_kv_side_channel_follow_the_mode():
    split = deployments(manifests(settings("ep/d")))
    assert flag(container(split["prefill"])["args"], "--role") == "encode_prefill"
    assert flag(container(split["decode"])["args"], "--role") == "decode"
    for stage in ("prefill", "decode"):
        c = container(split[stage])
        assert flag(c["args"], "--kv-port") == "5600"
        assert flag(c["args"], "--kv-host") == "$(POD_IP)"
        assert {"name": "kv", "containerPort": 5600} in c["ports"]
    three = deployments(manifests(settings("e/p/d")))
    assert flag(container(three["prefill"])["args"], "--role") == "prefill"
    whole = container(deployments(manifests(settings("epd")))["worker"])
    assert "--kv-port" not in whole["args"]
    assert [p["name"] for p in whole["ports"]] == ["grpc", "metrics", "health"]


@pytest.mark.parametrize("mode", MODES)
def test_probes_are_on_the_ports_the_stages_serve(mode):
    for stage, deployment in deployments(manifests(settings(mode))).items():
        c = container(deployment)
        port = int(flag(c["args"], "--port"))
        assert c["ports"][0]["containerPort"] == port
        if stage == "gateway":
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
        else:
            # Kubelet's gRPC probe has no client certificate: the plaintext health port.
            health = int(flag(c["args"], "--health-port"))
            assert c["readinessProbe"]["grpc"] == {"port": health} and health != port
            metrics = int(flag(c["args"], "--metrics-port"))
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(metrics)
        assert c["livenessProbe"]["tcpSocket"] == {"port": port}
        # The drain the stage is told fits in the pod's grace period.
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert float(flag(c["args"], "--shutdown-grace-s")) < grace


def test_gpus_and_replicas_where_asked():
    objects = manifests(settings("e/p/d", gpus=["prefill=1", "decode=2"], replicas=["decode=3"]))
    by_stage = deployments(objects)
    limits = {stage: container(d)["resources"]["limits"] for stage, d in by_stage.items()}
    gpus = {
        stage: limit["nvidia.com/gpu"]
        for stage, limit in limits.items()
        if "nvidia.com/gpu" in limit
    }
    assert gpus == {"prefill": 1, "decode": 2}
    assert by_stage["decode"]["spec"]["replicas"] == 3


def test_a_stage_the_mode_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="mode epd has no stage decode"):
        manifests(settings("epd", replicas=["decode=2"]))


def test_the_model_comes_from_a_claim_or_is_built_in_each_pod():
    claimed = manifests(KubernetesConfig(mode="epd", model="/models/m", model_pvc="models"))
    worker = pod(deployments(claimed)["worker"])
    (models,) = [volume for volume in worker["volumes"] if volume["name"] == "models"]
    assert models["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "initContainers" not in worker
    (init,) = pod(deployments(manifests(settings("epd")))["worker"])["initContainers"]
    assert init["args"] == ["model", "build", "--family", "llava", "--out", "/models/tiny-llava"]
    # The gateway reads no model.
    gateway = pod(deployments(claimed)["gateway"])
    assert "models" not in {volume["name"] for volume in gateway["volumes"]}


def test_the_yaml_is_one_stream_without_anchors():
    text = kubernetes.render(manifests(settings("e/p/d")))
    assert "&id" not in text and text.count("\n---\n") == len(manifests(settings("e/p/d"))) - 1


@pytest.mark.parametrize("mode", MODES)
def test_without_consul_each_stage_finds_its_peers_services_through_the_api_server(mode):
    objects = manifests(settings(mode, discovery="kubernetes"))
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for stage, deployment in deployments(objects).items():
        args = container(deployment)["args"]
        registry = build_parser().parse_args(args).registry
        if stage in ("gateway", "processor"):
            # The stages that call others discover them, with the token of the account.
            assert pod(deployment)["serviceAccountName"] == "prism"
            assert pod(deployment)["automountServiceAccountToken"] is True
            assert registry == "kubernetes:///prism"
        else:
            # Readiness registers the others: no registry, no token.
            assert "serviceAccountName" not in pod(deployment)
            assert pod(deployment)["automountServiceAccountToken"] is False
            assert registry == "static"
        # The registry reads a stage's address off its Service's first port.
        (port, *_) = services[f"prism-{stage}"]["spec"]["ports"]
        assert port["port"] == int(flag(args, "--port"))
    (account,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prism", "namespace": "prism"}
    ]
    # Consul needs none of it, and no pod gets a token.
    consul = manifests(settings(mode))
    assert not [o for o in consul if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert not [d for d in deployments(consul).values() if pod(d)["automountServiceAccountToken"]]


@pytest.mark.parametrize("mode", MODES)
def test_with_connect_sidecars_carry_every_grpc_hop_and_nixl_goes_pod_to_pod(mode):
    by_stage = deployments(manifests(settings(mode, discovery="connect")))
    callers = {"processor": STAGES[mode] - {"processor", "gateway"}, "gateway": {"processor"}}
    for stage, deployment in by_stage.items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["consul.hashicorp.com/connect-inject"] == "true"
        assert annotations["consul.hashicorp.com/transparent-proxy"] == "false"
        args = container(deployment)["args"]
        parsed = build_parser().parse_args(args)
        # Each role it calls, once, at its sidecar's upstream listener; nothing registers.
        peers = dict(p.split("=") for p in getattr(parsed, "peer", []))
        assert parsed.registry == "static"
        assert set(peers) == callers.get(stage, set())
        assert all(address.startswith("127.0.0.1:") for address in peers.values())
        upstreams = annotations.get("consul.hashicorp.com/connect-service-upstreams", "")
        expected = {f"prism-{role}:{address.split(':')[1]}" for role, address in peers.items()}
        assert set(filter(None, upstreams.split(","))) == expected
        # The sidecars' mutual TLS, not Prism's; under ACLs consul-k8s lets the sidecar in
        # with the token of an account named as the service.
        assert "--tls-cert" not in args and "--health-port" not in args
        assert pod(deployment)["serviceAccountName"] == f"prism-{stage}"
        assert pod(deployment)["automountServiceAccountToken"] is True


def every_container(deployment: dict) -> list[dict]:
    spec = pod(deployment)
    return spec["containers"] + spec.get("initContainers", [])


@pytest.mark.parametrize("planner", ("none", "slo"))
@pytest.mark.parametrize("discovery", DISCOVERY)
@pytest.mark.parametrize("mode", MODES)
def test_every_container_is_unprivileged_read_only_and_bounded(mode, discovery, planner):
    given = settings(mode, discovery=discovery, planner=PlannerConfig(planner=planner))
    for stage, deployment in deployments(manifests(given)).items():
        spec = pod(deployment)
        assert spec["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": security.UID, "runAsGroup": security.UID,
            "fsGroup": security.UID, "seccompProfile": {"type": "RuntimeDefault"},
        }  # fmt: skip
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for c in every_container(deployment):
            assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}  # fmt: skip
            assert not c["image"].endswith(":latest") and ":" in c["image"]
            assert c["imagePullPolicy"] == "IfNotPresent"
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound])
            # What a read-only root cannot hold: temporary files and the caches under
            # HOME, each on a volume of the pod.
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert {"/tmp", security.HOME} <= set(mounts)
            assert all(name in volumes for name in mounts.values())
        if stage in ("worker", "prefill", "decode"):
            # vLLM's CPU backend: its processes share tensors in memory.
            shm = {m["mountPath"]: m["name"] for m in container(deployment)["volumeMounts"]}
            assert volumes[shm["/dev/shm"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("discovery", DISCOVERY)
def test_the_mesh_lives_in_a_namespace_of_its_own_that_admits_only_hardened_pods(discovery):
    objects = manifests(settings("e/p/d", discovery=discovery))
    namespace, *rest = objects
    assert namespace["kind"] == "Namespace" and namespace["metadata"]["name"] == "prism"
    labels = namespace["metadata"]["labels"]
    # consul-k8s injects containers of its own into Connect's pods.
    expected = "baseline" if discovery == "connect" else "restricted"
    assert labels["pod-security.kubernetes.io/enforce"] == expected
    assert labels["pod-security.kubernetes.io/warn"] == "restricted"
    assert {o["metadata"]["namespace"] for o in rest} == {"prism"}
    other = manifests(settings("epd", namespace="inference"))
    assert {o["metadata"].get("namespace", o["metadata"]["name"]) for o in other} == {"inference"}


def reachable(objects: list[dict]) -> dict[str, set[tuple[str, int]]]:
    """Stage → the (source, port) pairs its NetworkPolicy lets in: a source is a stage, a
    namespace (`ns:NAME`) or anyone (`*`); a port range counts by its first port."""
    out: dict[str, set[tuple[str, int]]] = {}
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        stage = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        pairs = out.setdefault(stage, set())
        for rule in policy["spec"]["ingress"]:
            sources = []
            for source in rule.get("from", [{}]):
                if "podSelector" in source:
                    labels = source["podSelector"]["matchLabels"]
                    sources.append(labels["app.kubernetes.io/component"])
                elif "namespaceSelector" in source:
                    name = source["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                    sources.append(f"ns:{name}")
                else:
                    sources.append("*")
            pairs |= {(src, port["port"]) for src in sources for port in rule["ports"]}
    return out


@pytest.mark.parametrize("mode", MODES)
def test_each_stage_is_reached_only_by_the_stages_that_call_it(mode):
    objects = manifests(settings(mode))
    by_stage = deployments(objects)
    allowed = reachable(objects)
    assert set(allowed) == STAGES[mode]
    readers = {"e/pd": "worker", "e/p/d": "prefill"}
    for stage in STAGES[mode]:
        served = int(flag(container(by_stage[stage])["args"], "--port"))
        if stage == "gateway":
            assert allowed[stage] == {("*", served)}
            continue
        expected = {("gateway" if stage == "processor" else "processor", served),
                    ("ns:monitoring", METRICS_PORT), ("ns:consul", HEALTH_PORT)}  # fmt: skip
        if stage == "encoder":
            # NIXL: the engine that reads the embeddings dials the encoder's UCX listeners.
            expected.add((readers[mode], UCX_PORTS[0]))
        if stage == "prefill":
            # Decode fetches prefill's NIXL metadata on the side channel, then reads its KV.
            expected |= {("decode", KV_PORT), ("decode", UCX_PORTS[0])}
        assert allowed[stage] == expected, stage


def test_ucx_listens_where_the_network_policies_open():
    objects = manifests(settings("e/p/d"))
    (encoder,) = [o for o in objects if o["kind"] == "NetworkPolicy"
                  and o["metadata"]["name"] == "prism-encoder"]  # fmt: skip
    (ucx,) = [p for rule in encoder["spec"]["ingress"] for p in rule["ports"]
              if p.get("endPort")]  # fmt: skip
    for stage in ("encoder", "prefill", "decode"):
        env = {e["name"]: e.get("value") for e in container(deployments(objects)[stage])["env"]}
        assert env["UCX_TCP_PORT_RANGE"] == f"{ucx['port']}-{ucx['endPort']}"
        assert env["UCX_TLS"] == "tcp,self"  # no capability needed (CMA would want SYS_PTRACE)


def test_with_connect_the_callers_reach_the_sidecar_and_without_consul_no_check_comes_in():
    connect = reachable(manifests(settings("e/p/d", discovery="connect")))
    assert ("processor", CONNECT_INBOUND_PORT) in connect["encoder"]
    assert ("processor", 50052) not in connect["encoder"]
    api = reachable(manifests(settings("e/p/d", discovery="kubernetes")))
    assert not any(src == "ns:consul" for pairs in api.values() for src, _ in pairs)


@pytest.mark.parametrize("discovery", ("consul", "kubernetes"))
@pytest.mark.parametrize("mode", MODES)
def test_stages_call_each_other_over_mutual_tls_from_the_secret(mode, discovery):
    for stage, deployment in deployments(manifests(settings(mode, discovery=discovery))).items():
        c = container(deployment)
        parsed = build_parser().parse_args(c["args"])
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        root = mounts["tls"]["mountPath"]
        assert mounts["tls"]["readOnly"] is True
        # Its certificate and the CA: servers then require a client certificate too.
        assert (parsed.tls_cert, parsed.tls_key, parsed.tls_ca) == (
            f"{root}/tls.crt", f"{root}/tls.key", f"{root}/ca.crt",
        )  # fmt: skip
        # Peers are dialed by pod IP: the name their certificates carry is checked instead.
        assert parsed.tls_server_name == "prism-mesh"
        (secret,) = [v["secret"] for v in pod(deployment)["volumes"] if v["name"] == "tls"]
        assert secret == {"secretName": "prism-tls", "defaultMode": 0o440}
        if stage != "gateway":
            assert parsed.health_port == HEALTH_PORT


def test_without_a_tls_secret_stages_talk_plaintext_and_are_probed_on_their_port():
    for stage, deployment in deployments(manifests(settings("e/p/d", tls_secret=""))).items():
        c = container(deployment)
        assert "--tls-cert" not in c["args"] and "--health-port" not in c["args"]
        assert "tls" not in {v["name"] for v in pod(deployment)["volumes"]}
        if stage != "gateway":
            assert c["readinessProbe"]["grpc"] == {"port": int(flag(c["args"], "--port"))}


@pytest.mark.parametrize("discovery", DISCOVERY)
def test_every_skipped_check_is_named_and_justified_on_its_object(discovery):
    for stage, deployment in deployments(manifests(settings("e/p/d", discovery=discovery))).items():
        annotations = deployment["metadata"]["annotations"]
        skipped = dict(value.split("=", 1) for value in annotations.values())
        assert all(key.startswith("checkov.io/skip") for key in annotations)
        assert all(len(why) > 20 for why in skipped.values())
        token = discovery == "connect" or (discovery == "kubernetes" and stage in
                                           ("gateway", "processor"))  # fmt: skip
        assert set(skipped) == {"CKV_K8S_15", "CKV_K8S_43"} | ({"CKV_K8S_38"} if token else set())
    # An image by digest meets the digest check.
    pinned = settings("epd", image="registry.example/prism@sha256:" + "0" * 64)
    for deployment in deployments(manifests(pinned)).values():
        assert "CKV_K8S_43" not in str(deployment["metadata"]["annotations"])


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.mark.parametrize("discovery", DISCOVERY)
@pytest.mark.parametrize("mode", MODES)
def test_the_planners_role_may_only_read_and_set_the_scale_of_the_roles_it_scales(mode, discovery):
    objects = manifests(settings(mode, discovery=discovery, planner=SLO))
    role = by_kind(objects, "Role")["prism-planner"]
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "verbs": ["get", "patch"],
                              "resourceNames": [f"prism-{r}" for r in SCALED[mode]]}]  # fmt: skip
    # Each name is a Deployment of the mesh.
    assert set(role["rules"][0]["resourceNames"]) < set(by_kind(objects, "Deployment"))
    binding = by_kind(objects, "RoleBinding")["prism-planner"]
    assert binding["roleRef"]["name"] == "prism-planner"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "prism-planner", "namespace": "prism"}
    ]
    assert by_kind(objects, "ServiceAccount")["prism-planner"]["automountServiceAccountToken"]
    planner = deployments(objects)["planner"]
    assert pod(planner)["serviceAccountName"] == "prism-planner"
    assert pod(planner)["automountServiceAccountToken"] is True
    # One planner, even during a rollout.
    assert planner["spec"]["replicas"] == 1 and planner["spec"]["strategy"] == {"type": "Recreate"}
    annotations = planner["spec"]["template"]["metadata"]["annotations"]
    assert annotations["consul.hashicorp.com/connect-inject"] == "false"
    skipped = {value.split("=")[0] for value in planner["metadata"]["annotations"].values()}
    assert skipped == {"CKV_K8S_15", "CKV_K8S_43", "CKV_K8S_38"}


def test_the_planner_runs_prism_planner_on_the_processors_metrics():
    slo = PlannerConfig(planner="slo", ttft_slo_ms=1500.0, max_replicas=["decode=6"])
    objects = manifests(settings("e/p/d", planner=slo))
    args = container(deployments(objects)["planner"])["args"]
    front = f"http://prism-processor.prism.svc:{METRICS_PORT}/metrics"
    assert args[:7] == ["planner", "--mode", "e/p/d", "--backend", "kubernetes:///prism",
                        "--front-metrics", front]  # fmt: skip
    parser = argparse.ArgumentParser()
    PlannerStageConfig.add_cli_args(parser)
    parsed = PlannerStageConfig.from_args(parser.parse_args(args[1:]))
    assert parsed.planner == slo and parsed.metrics.metrics_port == METRICS_PORT
    assert (parsed.mode, parsed.front_metrics) == ("e/p/d", [front])
    # Headless: the Service's name resolves to every processor pod, each read apart.
    assert by_kind(objects, "Service")["prism-processor"]["spec"]["clusterIP"] == "None"
    (port,) = container(deployments(objects)["planner"])["ports"]
    assert port == {"name": "metrics", "containerPort": METRICS_PORT}


@pytest.mark.parametrize("mode", MODES)
def test_the_planner_reaches_the_processors_metrics_and_only_prometheus_reaches_it(mode):
    planned = reachable(manifests(settings(mode, planner=SLO)))
    plain = reachable(manifests(settings(mode)))
    assert planned["planner"] == {("ns:monitoring", METRICS_PORT)}
    assert planned["processor"] - plain["processor"] == {("planner", METRICS_PORT)}
    assert {k: v for k, v in planned.items() if k not in ("planner", "processor")} == {
        k: v for k, v in plain.items() if k != "processor"
    }


def test_the_planner_is_refused_bounds_on_roles_it_does_not_scale():
    bounded = PlannerConfig(planner="slo", max_replicas=["decode=2"])
    with pytest.raises(
        ValueError, match="--max-replicas: the planner of mode epd scales no decode"
    ):
        manifests(settings("epd", planner=bounded))


@pytest.mark.parametrize("discovery", DISCOVERY)
@pytest.mark.parametrize("mode", MODES)
def test_without_the_planner_nothing_changes_and_with_it_only_its_objects_are_added(
    mode, discovery
):
    plain = manifests(settings(mode, discovery=discovery))
    unplanned = PlannerConfig(planner="none", ttft_slo_ms=1.0, max_replicas=["decode=9"])
    assert manifests(settings(mode, discovery=discovery, planner=unplanned)) == plain
    assert "planner" not in kubernetes.render(plain)
    added = [o for o in manifests(settings(mode, discovery=discovery, planner=SLO))
             if o not in plain]  # fmt: skip
    assert sorted((o["kind"], o["metadata"]["name"]) for o in added) == [
        ("Deployment", "prism-planner"), ("NetworkPolicy", "prism-planner"),
        ("NetworkPolicy", "prism-processor"), ("Role", "prism-planner"),
        ("RoleBinding", "prism-planner"), ("ServiceAccount", "prism-planner"),
    ]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_a_service_monitor_scrapes_every_stage_where_asked(mode):
    assert not by_kind(manifests(settings(mode)), "ServiceMonitor")
    objects = manifests(settings(mode, service_monitor=True))
    monitor = by_kind(objects, "ServiceMonitor")["prism"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    for name, service in by_kind(objects, "Service").items():
        assert selector.items() <= service["metadata"]["labels"].items(), name
        named = {p["name"]: p["port"] for p in service["spec"]["ports"]}
        # Every stage's metrics through a named port of its Service; the gateway's own.
        assert named.get("metrics", named.get("http")) in (METRICS_PORT, 8000), name
        assert scraped & named.keys(), name


@pytest.mark.parametrize("mode", MODES)
def test_the_charts_values_are_the_manifests_own(mode):
    """The chart (deploy/helm/prism) renders its objects from these values; `make lint`
    renders it and compares with the manifests (scripts/kubernetes_manifests.sh)."""
    from prism.ops.deploy import helm

    given = settings(mode, planner=SLO, replicas=[f"{MODES[mode].roles[-1]}=2"])
    values = helm.values(given)
    objects = manifests(given)
    assert set(values["stages"]) == STAGES[mode]
    for stage, deployment in deployments(objects).items():
        if stage == "planner":
            assert values["planner"]["args"] == container(deployment)["args"]
            continue
        assert values["stages"][stage]["args"] == container(deployment)["args"]
        assert values["stages"][stage]["replicas"] == deployment["spec"]["replicas"]
    policies = by_kind(objects, "NetworkPolicy")
    assert {f"prism-{k}" for k in values["networkPolicies"]} == set(policies)
    assert values["planner"]["scales"] == [f"prism-{role}" for role in SCALED[mode]]
