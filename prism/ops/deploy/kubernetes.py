"""`prism deploy kubernetes`: the Kubernetes manifests of a mesh, from the plan that
`prism serve` starts (prism.ops.launcher.plan), so that which stages a mode has and how each
is started are said once.

Each stage becomes a Deployment and a Service: the gateway's a ClusterIP Service (the
door), every other a headless one (its pods, for discovery). Stages find each other
through Consul, as in compose.yaml (each pod registers its own IP); through the Envoy
sidecars consul-k8s injects (Connect); or, with no Consul, through the API server: the
ready pods of each headless Service, which a service account of the gateway and the
processor (the stages that call others) may list and watch (prism.registry.kubernetes).
Probes: readiness on the stage's `grpc.health.v1` (Kubernetes' own gRPC probe, on the
plaintext health port under mutual TLS; the gateway's `/health`), liveness and start-up on
its port being open, since a stage that is alive may rightly report NOT_SERVING (a
processor without workers yet, a stage draining). On SIGTERM a stage drains for
`--shutdown-grace-s`; the pod's grace period leaves room for that.

With `--planner slo`, a `prism planner` Deployment sets the replicas of the mode's roles
(encoder, worker, prefill, decode) through their Deployments' `scale` subresource, which
its Role lets it get and patch on those Deployments alone; it reads the processors'
metrics: the mesh scales on its own signals (latency against its goals, queues), not on
CPU, which says little of an engine's load.

With `--service-monitor`, a ServiceMonitor (the Prometheus Operator's) scrapes every
stage's metrics through the named `metrics` port of its Service (the gateway's on its own
port).

Hardened: every pod in the mesh's own namespace (prism.ops.deploy.security), mutual TLS
between stages (prism.ops.deploy.tls), a NetworkPolicy per stage (prism.ops.deploy.network_policy),
requests and limits on every container, and the service-account token only where the API
server or Consul Connect needs it.
"""

from __future__ import annotations

import itertools
import re
from importlib.metadata import version
from typing import Any

from prism.config.commands import MeshConfig, ServeConfig
from prism.config.common import AddressConfig, MetricsConfig, ModelConfig
from prism.config.deploy import KubernetesConfig
from prism.config.planner import role_counts
from prism.config.registry import RegistryConfig
from prism.modes import MODES
from prism.ops.deploy import network_policy, security, tls
from prism.ops.deploy.ports import ENGINES, HEALTH_PORT, KV_PORT, METRICS_PORT, UCX_PORTS, port
from prism.ops.plan import plan

# The image this checkout builds, by its fixed version.
IMAGE = f"prism:{version('prism-mesh')}"
MODELS = "/models"
# Engines: vLLM's CPU backend shares tensors between its processes through /dev/shm.
SHM = "2Gi"
# Seconds past the stage's own drain for the process to exit before SIGKILL.
EXIT_MARGIN_S = 15

# With Consul Connect sidecars: the local port of each role's upstream listener.
UPSTREAMS = {"processor": 21001, "encoder": 21002, "worker": 21003, "prefill": 21004,
             "decode": 21005}  # fmt: skip
_REWRITTEN = {"--host", "--port", "--metrics-port", "--kv-port", "--kv-host", "--peer"}
PLANNER = "planner"


def _stage_kind(name: str) -> str:
    """`prefill-0` → `prefill`: a Deployment per stage, whatever its replicas."""
    return re.sub(r"-\d+$", "", name)


def tls_on(settings: KubernetesConfig) -> bool:
    return bool(settings.tls_secret) and settings.discovery != "connect"


def _container_args(kind: str, argv: list[str], settings: KubernetesConfig) -> list[str]:
    """The plan's command line as the image's entrypoint (`prism`) takes it: bound to the
    pod's interfaces on fixed ports, reached at the pod's IP, peers found through Consul
    (or the API server, by the stages that call others), under mutual TLS."""
    # Plain strings: the plan's roles are str enums, whose str() would name the member.
    args = [str.__str__(arg) for arg in argv[argv.index("prism.cli") + 1 :]]
    rewritten = set(_REWRITTEN)
    if settings.discovery == "kubernetes" and kind not in network_policy.CALLERS:
        # Readiness registers it; it calls nobody, so it needs no registry (nor the token).
        rewritten.add("--registry")
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in rewritten:
            skip = True
        else:
            kept.append(arg)
    # Only the static registry has peers (one per replica): here, each role's upstream.
    for role in dict.fromkeys(_peer_roles(args)):
        kept += ["--peer", f"{role}=127.0.0.1:{UPSTREAMS[role]}"]
    kept += [*AddressConfig("0.0.0.0", port(kind)).to_argv(), "--advertise-host", "$(POD_IP)",
             "--shutdown-grace-s", str(settings.shutdown_grace_s)]  # fmt: skip
    if kind != "gateway":
        kept += MetricsConfig(metrics_port=METRICS_PORT).to_argv()
    if "--kv-port" in args:
        kept += ["--kv-host", "$(POD_IP)", "--kv-port", str(KV_PORT)]
    if tls_on(settings):
        kept += tls.args(settings.name, kind)
    return kept


def _peer_roles(args: list[str]) -> list[str]:
    """The roles of the `--peer ROLE=ADDRESS` pairs in `args`."""
    return [value.partition("=")[0] for arg, value in itertools.pairwise(args) if arg == "--peer"]


def _probes(kind: str, settings: KubernetesConfig) -> dict[str, Any]:
    served = port(kind)
    if kind == "gateway":
        ready: dict[str, Any] = {"httpGet": {"path": "/health", "port": served}}
    else:
        # Kubelet's gRPC probe has no client certificate: under mutual TLS, the health port.
        ready = {"grpc": {"port": HEALTH_PORT if tls_on(settings) else served}}
    open_port = {"tcpSocket": {"port": served}}
    return {
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**open_port, "periodSeconds": 10, "failureThreshold": 3},
        # An engine loads its model before it listens: up to 10 minutes.
        "startupProbe": {**open_port, "periodSeconds": 5, "failureThreshold": 120},
    }


def resources(kind: str, settings: KubernetesConfig) -> dict[str, Any]:
    """Requests, and limits at twice as much: room for bursts (an engine's start-up, a
    batch of large images) that cannot starve the node. An engine's /dev/shm counts
    against its memory."""
    engine = kind in ENGINES or kind == "encoder"
    cpu, memory = (2, 8) if engine else (1, 2)
    out: dict[str, Any] = {
        "requests": {"cpu": str(cpu), "memory": f"{memory}Gi"},
        "limits": {"cpu": str(2 * cpu), "memory": f"{2 * memory}Gi"},
    }
    if gpus := _counts(settings, "gpus").get(kind, 0):
        # Kubernetes takes extended resources as limits (requests default to them).
        out["limits"]["nvidia.com/gpu"] = gpus
    return out


def _labels(kind: str, settings: KubernetesConfig) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "prism",
        "app.kubernetes.io/instance": settings.name,
        "app.kubernetes.io/component": kind,
    }


def _meta(name: str, kind: str, settings: KubernetesConfig) -> dict[str, Any]:
    return {"name": name, "namespace": settings.namespace, "labels": _labels(kind, settings)}


def _token(kind: str, settings: KubernetesConfig) -> str:
    """Why stage `kind` needs its service-account token, or "" when it does not."""
    if settings.discovery == "kubernetes" and kind in network_policy.CALLERS:
        return "it reads EndpointSlices through the API server (prism.registry.kubernetes)"
    if settings.discovery == "connect":
        return "consul-k8s logs its injected sidecar in to Consul with it (ACLs)"
    return ""


def _container(name: str, settings: KubernetesConfig, **fields: Any) -> dict[str, Any]:
    """A container of the mesh: the image, `fields`, bounded and hardened."""
    return {"name": name, "image": image(settings), "imagePullPolicy": "IfNotPresent", **fields,
            "resources": resources(name, settings),
            "securityContext": security.container_context()}  # fmt: skip


def _pod(kind: str, args: list[str], settings: KubernetesConfig) -> dict[str, Any]:
    served = port(kind)
    ports = [{"name": "http" if kind == "gateway" else "grpc", "containerPort": served}]
    if kind != "gateway":
        ports.append({"name": "metrics", "containerPort": METRICS_PORT})
        if tls_on(settings):
            ports.append({"name": "health", "containerPort": HEALTH_PORT})
    if "--kv-port" in args:
        ports.append({"name": "kv", "containerPort": KV_PORT})
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if kind in ENGINES or kind == "encoder":
        # NIXL pod to pod: UCX's TCP transport works on every network; GPU pods let UCX
        # pick its GPU transports too. Its listeners stay in the range the NetworkPolicies
        # open.
        transports = "all" if _counts(settings, "gpus").get(kind) else "tcp,self"
        env.append({"name": "UCX_TLS", "value": transports})
        env.append({"name": "UCX_TCP_PORT_RANGE", "value": "{}-{}".format(*UCX_PORTS)})
    mounts, volumes = security.writable()
    init: list[dict[str, Any]] = []
    if kind != "gateway" and (settings.model_pvc or settings.tiny_model):
        mounts.append({"name": "models", "mountPath": MODELS, "readOnly": True})
        if settings.model_pvc:
            claim = {"claimName": settings.model_pvc, "readOnly": True}
            volumes.append({"name": "models", "persistentVolumeClaim": claim})
        else:
            volumes.append({"name": "models", "emptyDir": {}})
            writes = [*security.writable()[0], {"name": "models", "mountPath": MODELS}]
            build = ["model", "build", "--family", settings.tiny_model, "--out", settings.model]
            init.append(_container("model", settings, args=build, volumeMounts=writes))
    if kind in ENGINES:
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM}})
    if tls_on(settings):
        mount, volume = tls.volume(settings.tls_secret)
        mounts.append(mount)
        volumes.append(volume)
    container = _container(kind, settings, args=args, ports=ports, env=env,
                           **_probes(kind, settings), volumeMounts=mounts)  # fmt: skip
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(served if kind == "gateway" else METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    if settings.discovery == "connect":
        annotations |= {
            "consul.hashicorp.com/connect-inject": "true",
            "consul.hashicorp.com/connect-service-port": ports[0]["name"],
            # Only the gRPC hops ride the sidecar: NIXL (UCX) and the KV side channel go
            # pod to pod, which the transparent proxy would capture.
            "consul.hashicorp.com/transparent-proxy": "false",
        }
        if roles := _peer_roles(args):
            annotations["consul.hashicorp.com/connect-service-upstreams"] = ",".join(
                f"{settings.name}-{role}:{UPSTREAMS[role]}" for role in roles
            )
    else:
        # Stages reach each other directly, pod to pod: consul-k8s injects no sidecar.
        annotations["consul.hashicorp.com/connect-inject"] = "false"
    spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": settings.shutdown_grace_s + EXIT_MARGIN_S,
        "securityContext": security.pod_context(),
        "automountServiceAccountToken": bool(_token(kind, settings)),
        "containers": [container],
    }
    if settings.discovery == "kubernetes" and _token(kind, settings):
        spec["serviceAccountName"] = settings.name
    elif settings.discovery == "connect":
        # With ACLs, consul-k8s lets in only a service account named as the service.
        spec["serviceAccountName"] = f"{settings.name}-{kind}"
    if init:
        spec["initContainers"] = init
    spec["volumes"] = volumes
    return {"metadata": {"labels": _labels(kind, settings), "annotations": annotations},
            "spec": spec}  # fmt: skip


def _objects(kind: str, args: list[str], settings: KubernetesConfig) -> list[dict[str, Any]]:
    name = f"{settings.name}-{kind}"
    selector = {"matchLabels": _labels(kind, settings)}
    replicas = _counts(settings, "replicas").get(kind, 1)
    served = port(kind)
    service_port = {"name": "http" if kind == "gateway" else "grpc", "port": served,
                    "targetPort": served}  # fmt: skip
    service_spec: dict[str, Any] = {"selector": _labels(kind, settings), "ports": [service_port]}
    if kind != "gateway":
        # Headless: its DNS name and EndpointSlices list the pods themselves.
        service_spec["clusterIP"] = "None"
        # Named, for a ServiceMonitor (the gateway serves /metrics on its own port).
        service_spec["ports"].append({"name": "metrics", "port": METRICS_PORT,
                                      "targetPort": METRICS_PORT})  # fmt: skip
    objects = [
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                **_meta(name, kind, settings),
                "annotations": security.skips(image(settings), _token(kind, settings)),
            },
            "spec": {
                "replicas": replicas,
                "selector": selector,
                "template": _pod(kind, args, settings),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta(name, kind, settings),
            "spec": service_spec,
        },
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _meta(name, kind, settings),
            "spec": {"maxUnavailable": 1, "selector": selector},
        },
    ]
    if settings.discovery == "connect":
        objects.append({"apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": _meta(name, kind, settings),
                        "automountServiceAccountToken": False})  # fmt: skip
    return objects


def _discovery_access(settings: KubernetesConfig) -> list[dict[str, Any]]:
    """The service account of the stages that discover others, which may read the
    EndpointSlices of its namespace; its token is mounted only in their pods."""
    meta = {
        "name": settings.name,
        "namespace": settings.namespace,
        "labels": {"app.kubernetes.io/name": "prism", "app.kubernetes.io/instance": settings.name},
    }
    rule = {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    return _account(meta, rule, automount=False)


def _account(meta: dict[str, Any], rule: dict[str, Any], automount: bool) -> list[dict[str, Any]]:
    """A ServiceAccount named as `meta` says, and a Role of one `rule` bound to it."""
    subject = {"kind": "ServiceAccount", "name": meta["name"], "namespace": meta["namespace"]}
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta,
         "automountServiceAccountToken": automount},
        {"apiVersion": f"{rbac}/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {"apiVersion": f"{rbac}/v1", "kind": "RoleBinding", "metadata": meta,
         "roleRef": {"apiGroup": rbac, "kind": "Role", "name": meta["name"]},
         "subjects": [subject]},
    ]  # fmt: skip


def _scaled(settings: KubernetesConfig) -> list[str]:
    """The stages the planner scales: the mode's roles past the processor."""
    return [str(role) for role in MODES[settings.mode].roles]


def _check_planner(settings: KubernetesConfig) -> None:
    """Refuses what the planner cannot do beside the rest of the manifests."""
    scaled = _scaled(settings)
    for option in ("--min-replicas", "--max-replicas"):
        given = getattr(settings.planner, option.removeprefix("--").replace("-", "_"))
        if unknown := sorted(set(role_counts(given, option)) - set(scaled)):
            raise ValueError(
                f"{option}: the planner of mode {settings.mode} scales no {', '.join(unknown)} "
                f"(it scales {', '.join(scaled)})"
            )


def _planner_args(settings: KubernetesConfig) -> list[str]:
    """`prism planner`'s arguments: the mode's roles, scaled through the API server, against
    the metrics of every processor pod (its headless Service's name resolves to each)."""
    front = f"{settings.name}-{network_policy.FRONT}.{settings.namespace}.svc"
    return ["planner", "--mode", settings.mode, "--backend", f"kubernetes:///{settings.name}",
            "--front-metrics", f"http://{front}:{METRICS_PORT}/metrics",
            *settings.planner.to_argv(),
            *MetricsConfig(metrics_port=METRICS_PORT).to_argv()]  # fmt: skip


def _planner_access(settings: KubernetesConfig) -> list[dict[str, Any]]:
    """The planner's service account, whose Role may only read and set the replicas of the
    Deployments of the roles it scales (their `scale` subresource)."""
    name = f"{settings.name}-{PLANNER}"
    meta = _meta(name, PLANNER, settings)
    rule = {
        "apiGroups": ["apps"],
        "resources": ["deployments/scale"],
        "verbs": ["get", "patch"],
        "resourceNames": [f"{settings.name}-{role}" for role in _scaled(settings)],
    }
    return _account(meta, rule, automount=True)


def _planner(settings: KubernetesConfig) -> list[dict[str, Any]]:
    """The planner: its account, and one pod, hardened as the stages' are."""
    name = f"{settings.name}-{PLANNER}"
    labels = _labels(PLANNER, settings)
    mounts, volumes = security.writable()
    metrics = {"name": "metrics", "containerPort": METRICS_PORT}
    container = _container(
        PLANNER, settings, args=_planner_args(settings), ports=[metrics],
        readinessProbe={"httpGet": {"path": "/metrics", "port": METRICS_PORT},
                        "periodSeconds": 10},
        livenessProbe={"tcpSocket": {"port": METRICS_PORT}, "periodSeconds": 10,
                       "failureThreshold": 3},
        volumeMounts=mounts,
    )  # fmt: skip
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
        # It calls no stage over gRPC: no sidecar.
        "consul.hashicorp.com/connect-inject": "false",
    }
    token = "it scales the roles' Deployments through the API server (prism.planner.kubernetes)"
    spec = {
        "securityContext": security.pod_context(),
        "serviceAccountName": name,
        "automountServiceAccountToken": True,
        "containers": [container],
        "volumes": volumes,
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            **_meta(name, PLANNER, settings),
            "annotations": security.skips(image(settings), token),
        },
        "spec": {
            "replicas": 1,
            # Never two planners, even for the length of a rollout: each would scale.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels, "annotations": annotations},
                         "spec": spec},
        },
    }  # fmt: skip
    return [*_planner_access(settings), deployment]


def _registry(settings: KubernetesConfig) -> RegistryConfig:
    if settings.discovery == "kubernetes":
        return RegistryConfig(f"kubernetes:///{settings.name}")
    if settings.discovery == "consul":
        return RegistryConfig(f"consul://{settings.consul}")
    if settings.discovery == "connect":
        return RegistryConfig()  # the static registry: each role at its sidecar upstream
    raise ValueError(f"discovery is consul, connect or kubernetes, not {settings.discovery!r}")


def stages(settings: KubernetesConfig) -> dict[str, list[str]]:
    """Each stage of the mode, in start order, and its container's arguments."""
    config = MeshConfig(
        ModelConfig(settings.model),
        # Gateway and processor apart, so that each scales on its own.
        ServeConfig(settings.mode, front="split"),
        routing=settings.routing,
        registry=_registry(settings),
    )
    out: dict[str, list[str]] = {}
    for stage in plan(config):
        kind = _stage_kind(stage.name)
        out.setdefault(kind, _container_args(kind, stage.argv, settings))
    return out


def manifests(settings: KubernetesConfig) -> list[dict[str, Any]]:
    """The mesh's Kubernetes objects."""
    planned = stages(settings)
    for what in ("replicas", "gpus"):
        unknown = sorted(set(_counts(settings, what)) - set(planned))
        if unknown:
            raise ValueError(
                f"--{what}: mode {settings.mode} has no stage {', '.join(unknown)} "
                f"(its stages: {', '.join(planned)})"
            )
    planner = settings.planner.planner == "slo"
    if planner:
        _check_planner(settings)
    # consul-k8s's injected containers may not meet `restricted`: only warned of there.
    enforce = "baseline" if settings.discovery == "connect" else "restricted"
    access = _discovery_access(settings) if settings.discovery == "kubernetes" else []
    objects = [obj for kind, args in planned.items() for obj in _objects(kind, args, settings)]
    if planner:
        objects += _planner(settings)
    policies = network_policy.policies(
        settings.name,
        settings.namespace,
        {kind: _labels(kind, settings) for kind in planned},
        settings.discovery,
        settings.consul,
        settings.metrics_namespace,
        tls_on(settings),
        _labels(PLANNER, settings) if planner else None,
    )
    monitor = [_service_monitor(settings)] if settings.service_monitor else []
    return [security.namespace(settings.namespace, enforce), *access, *objects, *policies,
            *monitor]  # fmt: skip


def _service_monitor(settings: KubernetesConfig) -> dict[str, Any]:
    """Prometheus scrapes each Service's `metrics` port, and the gateway's `http` one."""
    labels = {"app.kubernetes.io/name": "prism", "app.kubernetes.io/instance": settings.name}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": settings.name, "namespace": settings.namespace, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "endpoints": [{"port": name, "path": "/metrics"} for name in ("metrics", "http")],
        },
    }


def _counts(settings: KubernetesConfig, what: str) -> dict[str, int]:
    """`--replicas` or `--gpus` (`what`): STAGE → N."""
    out = {}
    for value in getattr(settings, what):
        role, sep, count = value.partition("=")
        if not sep or not count.isdigit():
            raise SystemExit(f"--{what} takes STAGE=N, got {value!r}")
        out[role] = int(count)
    return out


def image(settings: KubernetesConfig) -> str:
    return settings.image or IMAGE


def render(objects: list[dict[str, Any]]) -> str:
    """The objects as one YAML stream, each written out in full (no anchors)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(objects, Dumper=Dumper, sort_keys=False, default_flow_style=False)
