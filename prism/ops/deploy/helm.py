"""`prism deploy helm`: a values file of the Helm chart deploy/helm/prism, which renders
exactly the objects `prism deploy kubernetes` writes for the same flags.

The chart's templates hold what every mesh shares (names, labels, the hardening, the
volumes, the Services and PodDisruptionBudgets, the accounts, the NetworkPolicies'
shape); the values hold what a mode decides, taken here from the manifests themselves
(prism.ops.deploy.kubernetes), so that the two cannot say different things: each stage's
command line, ports, probes, resources and replicas, and each NetworkPolicy's rules.
`make lint` renders the chart with each committed values file and compares it with the
manifests (scripts/helm_chart.sh).
"""

from __future__ import annotations

from typing import Any

from prism.config.deploy import KubernetesConfig
from prism.ops.deploy import kubernetes
from prism.ops.deploy.ports import METRICS_PORT

PROBES = ("readinessProbe", "livenessProbe", "startupProbe")


def _stage(deployment: dict[str, Any], service: dict[str, Any]) -> dict[str, Any]:
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    return {
        "replicas": deployment["spec"]["replicas"],
        "args": container["args"],
        "ports": container["ports"],
        "env": container["env"],
        "probes": {probe: container[probe] for probe in PROBES},
        "resources": container["resources"],
        "shm": any(volume["name"] == "shm" for volume in pod["spec"]["volumes"]),
        "serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "automountServiceAccountToken": pod["spec"]["automountServiceAccountToken"],
        "annotations": deployment["metadata"]["annotations"],
        "podAnnotations": pod["metadata"]["annotations"],
        "servicePorts": service["spec"]["ports"],
    }


def _planner(deployment: dict[str, Any], role: dict[str, Any]) -> dict[str, Any]:
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    return {
        "enabled": True,
        "args": container["args"],
        "probes": {probe: container[probe] for probe in PROBES if probe in container},
        "resources": container["resources"],
        "annotations": deployment["metadata"]["annotations"],
        "podAnnotations": pod["metadata"]["annotations"],
        "scales": role["rules"][0]["resourceNames"],
    }


def values(settings: KubernetesConfig) -> dict[str, Any]:
    """The chart's values for the mesh `settings` describes."""
    objects = kubernetes.manifests(settings)
    found = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    name = settings.name
    namespace = found[("Namespace", settings.namespace)]
    stages = {
        kind: _stage(found[("Deployment", f"{name}-{kind}")], found[("Service", f"{name}-{kind}")])
        for kind in kubernetes.stages(settings)
    }
    planned = f"{name}-{kubernetes.PLANNER}"
    planner: dict[str, Any] = {"enabled": False}
    if ("Deployment", planned) in found:
        planner = _planner(found[("Deployment", planned)], found[("Role", planned)])
    policies = {
        o["metadata"]["labels"]["app.kubernetes.io/component"]: o["spec"]["ingress"]
        for o in objects
        if o["kind"] == "NetworkPolicy"
    }
    return {
        "name": name,
        "namespace": settings.namespace,
        "podSecurity": namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "image": kubernetes.image(settings),
        "model": {"path": settings.model, "pvc": settings.model_pvc, "tiny": settings.tiny_model},
        "initResources": kubernetes.resources("model", settings),
        "tlsSecret": settings.tls_secret if kubernetes.tls_on(settings) else "",
        "discovery": settings.discovery,
        "discoveryAccess": ("ServiceAccount", name) in found,
        "terminationGracePeriodSeconds": settings.shutdown_grace_s + kubernetes.EXIT_MARGIN_S,
        "metricsPort": METRICS_PORT,
        "stages": stages,
        "planner": planner,
        "networkPolicies": policies,
        "serviceMonitor": {"enabled": settings.service_monitor},
    }


def render(values: dict[str, Any]) -> str:
    """The values as YAML, headed by what may be changed in them."""
    import yaml

    head = (
        "# The mode's choices (stages, command lines, ports, discovery, TLS, the planner) come\n"
        "# from those flags: write the file again to change them. Replicas, resources, the\n"
        "# image and serviceMonitor.enabled may be set here or with --set.\n"
    )
    return head + yaml.safe_dump(values, sort_keys=False, default_flow_style=False, width=100)
