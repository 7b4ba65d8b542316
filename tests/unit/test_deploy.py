"""`prism deploy kubernetes`: each mode's manifests have exactly the stages the mode needs,
wired as `prism serve` wires them, probed on the ports they serve."""

from __future__ import annotations

import pytest

from prism.cli import build_parser
from prism.deploy import kubernetes
from prism.deploy.kubernetes import Settings, manifests
from prism.modes import MODES

STAGES = {
    "epd": {"worker", "processor", "gateway"},
    "e/pd": {"encoder", "worker", "processor", "gateway"},
    "e/p/d": {"encoder", "prefill", "decode", "processor", "gateway"},
    "ep/d": {"prefill", "decode", "processor", "gateway"},
}


def deployments(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o
            for o in objects if o["kind"] == "Deployment"}  # fmt: skip


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def settings(mode: str, **given) -> Settings:
    return Settings(mode=mode, model="/models/tiny-llava", tiny_model="llava", **given)


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
    assert "--kv-port" not in whole["args"] and len(whole["ports"]) == 2


@pytest.mark.parametrize("mode", MODES)
def test_probes_are_on_the_ports_the_stages_serve(mode):
    for stage, deployment in deployments(manifests(settings(mode))).items():
        c = container(deployment)
        port = int(flag(c["args"], "--port"))
        assert c["ports"][0]["containerPort"] == port
        if stage == "gateway":
            assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
        else:
            assert c["readinessProbe"]["grpc"] == {"port": port}
            metrics = int(flag(c["args"], "--metrics-port"))
            annotations = deployment["spec"]["template"]["metadata"]["annotations"]
            assert annotations["prometheus.io/port"] == str(metrics)
        assert c["livenessProbe"]["tcpSocket"] == {"port": port}
        # The drain the stage is told fits in the pod's grace period.
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert float(flag(c["args"], "--shutdown-grace-s")) < grace


def test_gpus_replicas_and_autoscaling_where_asked():
    objects = manifests(settings("e/p/d", gpus={"prefill": 1, "decode": 2},
                                 replicas={"decode": 3}, autoscale={"decode": 6}))  # fmt: skip
    by_stage = deployments(objects)
    limits = {stage: container(d)["resources"].get("limits") for stage, d in by_stage.items()}
    gpus = {stage: limit["nvidia.com/gpu"] for stage, limit in limits.items() if limit}
    assert gpus == {"prefill": 1, "decode": 2}
    assert by_stage["decode"]["spec"]["replicas"] == 3
    (hpa,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "prism-decode"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 6)


def test_a_stage_the_mode_lacks_is_refused_by_name():
    with pytest.raises(ValueError, match="mode epd has no stage decode"):
        manifests(settings("epd", replicas={"decode": 2}))


def test_the_model_comes_from_a_claim_or_is_built_in_each_pod():
    claimed = manifests(Settings(mode="epd", model="/models/m", model_pvc="models"))
    pod = deployments(claimed)["worker"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "initContainers" not in pod
    built = deployments(manifests(settings("epd")))["worker"]["spec"]["template"]["spec"]
    (init,) = built["initContainers"]
    assert init["args"] == ["model", "build", "--family", "llava", "--out", "/models/tiny-llava"]
    # The gateway reads no model.
    assert "volumes" not in deployments(claimed)["gateway"]["spec"]["template"]["spec"]


def test_the_yaml_is_one_stream_without_anchors():
    text = kubernetes.render(manifests(settings("e/p/d")))
    assert "&id" not in text and text.count("\n---\n") == len(manifests(settings("e/p/d"))) - 1


@pytest.mark.parametrize("mode", MODES)
def test_without_consul_each_stage_finds_its_peers_services_through_the_api_server(mode):
    objects = manifests(settings(mode, discovery="kubernetes"))
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for stage, deployment in deployments(objects).items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "prism"
        args = container(deployment)["args"]
        assert build_parser().parse_args(args).registry == "kubernetes:///prism"
        # The registry reads a stage's address off its Service's first port.
        (port, *_) = services[f"prism-{stage}"]["spec"]["ports"]
        assert port["port"] == int(flag(args, "--port"))
    (role,) = [o for o in objects if o["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["get", "list", "watch"]}]  # fmt: skip
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prism"}]
    # Consul needs none of it.
    consul = manifests(settings(mode))
    assert not [o for o in consul if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]


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
