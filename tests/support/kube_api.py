"""A fake of the Kubernetes API server's EndpointSlices, Deployments' `scale` subresource
and RBAC, for the tests of the Kubernetes registry and of the planner's backend (no
cluster runs here). It speaks the real JSON and protocol:

- `GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=K=V`
  answers an `EndpointSliceList` with the list's `resourceVersion`;
- with `watch=1&resourceVersion=N` it streams, chunked, one JSON event per line (ADDED,
  MODIFIED, DELETED, ERROR) for every change after N, until `timeoutSeconds` or an ERROR
  (a 410 Status where the watch expired), as the API server does;
- `GET /apis/apps/v1/namespaces/<ns>/deployments/<name>/scale` answers the Deployment's
  `autoscaling/v1` Scale, and a `PATCH` of it (`application/merge-patch+json`, 415 for
  any other type) sets its replicas (at once: no pods start here); 404 for a Deployment
  it does not hold;
- once any token is granted rules (`grant`), every request is authorized as RBAC does:
  401 without a granted bearer token, 403 (a Forbidden Status, worded as the API server
  words it) where no rule of the token allows the request's verb, API group, resource
  (`deployments/scale` for a subresource) and object name.

Slices are set with `put` and `delete`; `expire_watches` ends every watch with 410.
Deployments are set with `put_deployment`. Every GET's query is recorded (`requests`).
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

SERVICE_LABEL = "kubernetes.io/service-name"
MERGE_PATCH = "application/merge-patch+json"
# The verb a request's method asks for, before a collection's `get` becomes list or watch.
_VERBS = {"GET": "get", "HEAD": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
          "DELETE": "delete"}  # fmt: skip


def endpoint_slice(
    name: str, service: str, pods: dict[str, bool], port: int = 50051, namespace: str = "mesh"
) -> dict[str, Any]:
    """An EndpointSlice as the controller writes it; `pods`: address → ready."""
    return {
        "kind": "EndpointSlice",
        "apiVersion": "discovery.k8s.io/v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                SERVICE_LABEL: service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [address],
                "conditions": {"ready": ready, "serving": ready, "terminating": not ready},
                "targetRef": {"kind": "Pod", "namespace": namespace, "name": f"pod-{i}"},
            }
            for i, (address, ready) in enumerate(pods.items())
        ],
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
    }


def status(code: int, reason: str, message: str, **details: str) -> dict[str, Any]:
    """A failure as the API server answers it: a `Status`."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                            "status": "Failure", "message": message, "reason": reason}  # fmt: skip
    if details:
        body["details"] = details
    return body | {"code": code}


@dataclass(frozen=True)
class Attributes:
    """What RBAC authorizes of a request (the API server's RequestInfo)."""

    verb: str
    group: str
    resource: str
    subresource: str
    namespace: str
    name: str

    @property
    def qualified(self) -> str:
        """`deployments.apps`: the resource with its group, as errors name it."""
        return f"{self.resource}.{self.group}" if self.group else self.resource

    @property
    def combined(self) -> str:
        """`deployments/scale`: the resource as rules name it."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def attributes(method: str, path: str, query: dict[str, str]) -> Attributes | None:
    """The request's attributes; None for a path outside the API (/healthz, /version)."""
    parts = path.strip("/").split("/")
    if parts[0] == "api" and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) > 1:
        namespace = rest[1]
        if len(rest) > 2:
            rest = rest[2:]
    name = rest[1] if len(rest) > 1 else ""
    verb = _VERBS.get(method, method.lower())
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in ("1", "true") else "list"
    elif not name and verb == "delete":
        verb = "deletecollection"
    return Attributes(verb, group, rest[0], rest[2] if len(rest) > 2 else "", namespace, name)


def allows(rule: dict[str, Any], request: Attributes) -> bool:
    """Whether one PolicyRule allows the request, as RBAC's RuleAllows decides."""

    def among(values: list[str], value: str) -> bool:
        return "*" in values or value in values

    resources = rule.get("resources", [])
    resource = among(resources, request.combined) or (
        bool(request.subresource) and f"*/{request.subresource}" in resources
    )
    names = rule.get("resourceNames") or []
    return (
        among(rule.get("verbs", []), request.verb)
        and among(rule.get("apiGroups", []), request.group)
        and resource
        and (not names or request.name in names)
    )


def forbidden(user: str, request: Attributes) -> dict[str, Any]:
    """The 403 Status of a request no rule allows, worded as the API server's."""
    subject = f'{request.qualified} "{request.name}"' if request.name else request.qualified
    scope = (f'in the namespace "{request.namespace}"' if request.namespace
             else "at the cluster scope")  # fmt: skip
    message = (f'{subject} is forbidden: User "{user}" cannot {request.verb} resource '
               f'"{request.combined}" in API group "{request.group}" {scope}')  # fmt: skip
    details = {"group": request.group, "kind": request.resource}
    if request.name:
        details["name"] = request.name
    return status(403, "Forbidden", message, **details)


def deployment(name: str, replicas: int = 1, namespace: str = "mesh") -> dict[str, Any]:
    """A Deployment as the API server holds it (the fields a Scale reads)."""
    labels = {"app": name}
    return {
        "kind": "Deployment",
        "apiVersion": "apps/v1",
        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels}},
        "status": {"replicas": replicas},
    }


_EXPIRED = status(410, "Expired", "too old resource version")


class KubeApi:
    def __init__(self, namespace: str = "mesh") -> None:
        self.namespace = namespace
        self.version = 1
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.requests: list[dict[str, str]] = []
        self.deployments: dict[str, dict[str, Any]] = {}
        # Bearer token → its user and the rules of its roles; empty: no authorization.
        self.grants: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        # It looks for a shutdown every 50 ms: a test's server stops at once.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)  # fmt: skip

    def __enter__(self) -> KubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _event(self, kind: str, item: dict[str, Any]) -> None:
        with self._changed:
            self.version += 1
            item = copy.deepcopy(item)
            item["metadata"]["resourceVersion"] = str(self.version)
            if kind == "DELETED":
                self.slices.pop(item["metadata"]["name"], None)
            elif kind != "ERROR":
                self.slices[item["metadata"]["name"]] = item
            self.events.append((self.version, {"type": kind, "object": item}))
            self._changed.notify_all()

    def put(self, item: dict[str, Any]) -> None:
        name = item["metadata"]["name"]
        self._event("MODIFIED" if name in self.slices else "ADDED", item)

    def delete(self, name: str) -> None:
        self._event("DELETED", self.slices[name])

    def expire_watches(self) -> None:
        self._event("ERROR", _EXPIRED)

    def put_deployment(self, name: str, replicas: int = 1) -> None:
        """Adds Deployment `name`, or sets its replicas."""
        with self._changed:
            self.version += 1
            held = self.deployments.setdefault(name, deployment(name, replicas, self.namespace))
            held["spec"]["replicas"] = held["status"]["replicas"] = replicas
            held["metadata"]["resourceVersion"] = str(self.version)

    def grant(self, token: str, rules: list[dict[str, Any]], user: str = "") -> None:
        """Lets bearer `token` (of `user`, by default a service account named as the
        token) do what `rules` allow; from then on every request is authorized."""
        self.grants[token] = (user or f"system:serviceaccount:{self.namespace}:{token}", rules)

    def authorize(self, method: str, path: str, query: dict[str, str],
                  authorization: str) -> tuple[int, dict[str, Any]] | None:  # fmt: skip
        """The refusal of a request RBAC would refuse, or None."""
        if not self.grants:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or token not in self.grants:
            return 401, status(401, "Unauthorized", "Unauthorized")
        user, rules = self.grants[token]
        request = attributes(method, path, query)
        if request is None:  # a path outside the API: no rule here names one
            message = f'forbidden: User "{user}" cannot {method.lower()} path "{path}"'
            return 403, status(403, "Forbidden", message)
        if any(allows(rule, request) for rule in rules):
            return None
        return 403, forbidden(user, request)

    def scale(self, name: str) -> dict[str, Any]:
        """Deployment `name`'s `autoscaling/v1` Scale."""
        held = self.deployments[name]
        labels = held["spec"]["selector"]["matchLabels"]
        spec = {"replicas": held["spec"]["replicas"]} if held["spec"]["replicas"] else {}
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": held["metadata"]["uid"],
                "resourceVersion": held["metadata"]["resourceVersion"],
            },
            "spec": spec,
            "status": {
                "replicas": held["status"]["replicas"],
                "selector": ",".join(f"{k}={v}" for k, v in labels.items()),
            },
        }

    @property
    def _last_event(self) -> int:
        return self.events[-1][0] if self.events else 0

    def _selected(self, item: dict[str, Any], selector: str) -> bool:
        key, _, value = selector.partition("=")
        labels = item["metadata"].get("labels", {})
        return item["kind"] == "Status" or labels.get(key) == value

    def patch_scale(self, name: str, patch: Any) -> tuple[int, dict[str, Any]]:
        """A merge patch of Deployment `name`'s Scale: its answer."""
        replicas = (patch.get("spec") or {}).get("replicas") if isinstance(patch, dict) else None
        if type(replicas) is not int or replicas < 0:
            message = f'Scale.autoscaling "{name}" is invalid: spec.replicas: Invalid value'
            return 422, status(422, "Invalid", message, name=name, group="autoscaling",
                               kind="Scale")  # fmt: skip
        self.put_deployment(name, replicas)
        return 200, self.scale(name)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self
        slices = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"
        deployments = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/"

        def scaled(path: str) -> str | None:
            """The Deployment whose Scale `path` names, or None."""
            name, sep, rest = path.removeprefix(deployments).partition("/")
            found = path.startswith(deployments) and sep and rest == "scale" and name
            return name if found else None

        def not_found(name: str) -> dict[str, Any]:
            return status(404, "NotFound", f'deployments.apps "{name}" not found', name=name,
                          group="apps", kind="deployments")  # fmt: skip

        unserved = status(404, "NotFound", "the server could not find the requested resource")

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _body(self) -> bytes:
                # Read whole before any answer: the connection may carry another request.
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _refused(self) -> bool:
                """Whether RBAC refuses the request (then answered)."""
                url = urlsplit(self.path)
                refusal = api.authorize(self.command, url.path, dict(parse_qsl(url.query)),
                                        self.headers.get("Authorization", ""))  # fmt: skip
                if refusal:
                    self._json(*refusal)
                return refusal is not None

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = dict(parse_qsl(url.query))
                api.requests.append(query)
                if self._refused():
                    return
                if url.path == slices:
                    self._slices(query)
                elif (name := scaled(url.path)) is None:
                    self._json(404, unserved)
                elif name not in api.deployments:
                    self._json(404, not_found(name))
                else:
                    self._json(200, api.scale(name))

            def do_PATCH(self) -> None:
                body = self._body()
                if self._refused():
                    return
                name = scaled(urlsplit(self.path).path)
                kind = self.headers.get("Content-Type", "").partition(";")[0].strip()
                if name is None:
                    self._json(404, unserved)
                elif kind != MERGE_PATCH:
                    message = (f"the body of the request was in an unknown format - accepted "
                               f"media types include: {MERGE_PATCH}")  # fmt: skip
                    self._json(415, status(415, "UnsupportedMediaType", message))
                elif name not in api.deployments:
                    self._json(404, not_found(name))
                else:
                    self._json(*api.patch_scale(name, json.loads(body or b"null")))

            def _unserved(self) -> None:
                self._body()
                if not self._refused():
                    self._json(404, unserved)

            do_POST = do_PUT = do_DELETE = _unserved

            def _slices(self, query: dict[str, str]) -> None:
                selector = query.get("labelSelector", "")
                if query.get("watch") not in ("1", "true"):
                    with api._changed:
                        items = [s for s in api.slices.values() if api._selected(s, selector)]
                        version = str(api.version)
                    listed = {
                        "kind": "EndpointSliceList",
                        "apiVersion": "discovery.k8s.io/v1",
                        "metadata": {"resourceVersion": version},
                        "items": items,
                    }
                    self._json(200, listed)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                sent = int(query["resourceVersion"])
                deadline = time.monotonic() + float(query.get("timeoutSeconds", 1800))
                while True:
                    with api._changed:
                        # On events, not the version: a Deployment's change moves it too.
                        api._changed.wait_for(
                            lambda sent=sent: api._closed or api._last_event > sent,
                            timeout=max(0.0, deadline - time.monotonic()),
                        )
                        new = [(v, e) for v, e in api.events if v > sent]
                        ended = api._closed or time.monotonic() >= deadline
                    for version, event in new:
                        sent = version
                        if api._selected(event["object"], selector):
                            self._chunk(json.dumps(event).encode() + b"\n")
                        if event["type"] == "ERROR":
                            ended = True
                            break
                    if ended:
                        self._chunk(b"")
                        return

        return Handler
