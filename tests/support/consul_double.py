"""A double of the Consul agent's HTTP API, for the tests of the Consul registry.

It is a double, not Consul: no Consul binary can be installed on the machines these tests
run on (compose.yaml runs the real agent). It does what Prism relies on, the way Consul
does it:

- `PUT /v1/agent/service/register` decodes the body as Consul's Go decoder does (field
  names match whatever their case or snake_case spelling; an unknown field is a 400), keeps
  the service and its check, and registers a Connect sidecar service when asked.
- `PUT /v1/agent/service/deregister/<id>` removes a service, its check and its sidecar.
- `GET /v1/health/service/<name>` answers entries of Node, Service and Checks, filtered by
  `tag` (all must match) and `passing`. With `index`, it is a blocking query: it holds the
  request until the index moves past `index` or `wait` (default 5 min) elapses, and answers
  with the current index in `X-Consul-Index`.
- Checks run like the agent's: a new check starts critical; a gRPC check calls
  `grpc.health.v1.Health/Check` on its `GRPC` target, an HTTP check expects a 2xx, each
  every `Interval` with `Timeout`; a service critical for `DeregisterCriticalServiceAfter`
  is deregistered.
- With an ACL token set, a request without it (header `X-Consul-Token` or `?token=`) gets
  403.

Every request is recorded (`requests`) so that tests can assert what was sent.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prism.rpc.channel import check_health

NODE = {"ID": "5c5e0f0e-0000-4000-8000-000000000001", "Node": "double", "Address": "127.0.0.1",
        "Datacenter": "dc1", "TaggedAddresses": {}, "Meta": {}}  # fmt: skip

# The fields of Consul's service definition that the double knows, by their Go names;
# nested objects map to their own field tables.
_UPSTREAM = {"DestinationType": None, "DestinationName": None, "DestinationNamespace": None,
             "Datacenter": None, "LocalBindAddress": None, "LocalBindPort": None,
             "Config": None}  # fmt: skip
_PROXY = {"DestinationServiceName": None, "LocalServiceAddress": None, "LocalServicePort": None,
          "Config": None, "Upstreams": [_UPSTREAM]}  # fmt: skip
_CHECK = {"CheckID": None, "Name": None, "Notes": None, "Status": None, "GRPC": None,
          "GRPCUseTLS": None, "HTTP": None, "Header": None, "Method": None, "TCP": None,
          "TTL": None, "Interval": None, "Timeout": None, "TLSSkipVerify": None,
          "DeregisterCriticalServiceAfter": None}  # fmt: skip
_SIDECAR = {"Port": None, "Address": None, "Tags": None, "Meta": None, "Proxy": _PROXY,
            "Checks": [_CHECK], "Check": _CHECK}  # fmt: skip
_SERVICE = {"ID": None, "Name": None, "Tags": None, "Address": None, "TaggedAddresses": None,
            "Meta": None, "Port": None, "Check": _CHECK, "Checks": [_CHECK],
            "EnableTagOverride": None, "Weights": None, "Kind": None, "Proxy": _PROXY,
            "Connect": {"Native": None, "SidecarService": _SIDECAR}, "SocketPath": None,
            "Locality": None}  # fmt: skip


class DecodeError(ValueError):
    pass


def _fold(name: str) -> str:
    return name.replace("_", "").lower()


def decode(value: Any, schema: Any) -> Any:
    """`value` with its field names spelled as Consul's Go structs spell them."""
    if schema is None or value is None:
        return value
    if isinstance(schema, list):
        if not isinstance(value, list):
            raise DecodeError(f"expected a list, got {value!r}")
        return [decode(item, schema[0]) for item in value]
    if not isinstance(value, dict):
        raise DecodeError(f"expected an object, got {value!r}")
    names = {_fold(name): name for name in schema}
    decoded = {}
    for key, item in value.items():
        name = names.get(_fold(key))
        if name is None:
            raise DecodeError(f'json: unknown field "{key}"')
        decoded[name] = decode(item, schema[name])
    return decoded


def duration(text: str) -> float:
    """Seconds in a Go duration such as "1m30s", "500ms" or "10s"."""
    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise DecodeError(f"invalid duration {text!r}")
    return sum(float(n) * units[u] for n, u in parts)


@dataclass
class Registered:
    definition: dict[str, Any]
    index: int
    status: str = "critical"
    output: str = ""
    next_check: float = 0.0
    critical_since: float = field(default_factory=time.monotonic)

    @property
    def check(self) -> dict[str, Any] | None:
        checks = self.definition.get("Checks") or []
        return self.definition.get("Check") or (checks[0] if checks else None)


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any
    # When it came in (time.monotonic()), before it was answered: how a client paces itself.
    at: float = field(default_factory=time.monotonic)


class ConsulDouble:
    def __init__(self, token: str = "", tick: float = 0.05):
        self.token = token
        self.requests: list[Request] = []
        self.services: dict[str, Registered] = {}
        # Every change of a check's status: (service name, status, output).
        self.transitions: list[tuple[str, str, str]] = []
        self.index = 10
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._tick = tick
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.address = f"127.0.0.1:{self._http.server_port}"
        self._threads = [
            threading.Thread(target=self._http.serve_forever, daemon=True),
            threading.Thread(target=self._run_checks, daemon=True),
        ]

    def __enter__(self) -> ConsulDouble:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._http.shutdown()
        self._http.server_close()
        for thread in self._threads:
            thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"consul://{self.address}"

    def _bump(self) -> None:
        # Callers hold self._changed.
        self.index += 1
        self._changed.notify_all()

    def queries(self, name: str) -> list[Request]:
        path = f"/v1/health/service/{name}"
        return [r for r in self.requests if r.method == "GET" and r.path == path]

    def states(self) -> dict[str, tuple[str, str]]:
        """Status and last check output of every service, by ID (to explain a failure)."""
        with self._changed:
            return {s: (r.status, r.output) for s, r in self.services.items()}

    def passing(self, name: str) -> list[str]:
        """IDs of the instances of `name` that Consul would list as passing."""
        with self._changed:
            return [s for s, r in self.services.items()
                    if r.definition["Name"] == name and r.status == "passing"]  # fmt: skip

    # Requests.

    def _register(self, body: Any, query: dict[str, list[str]]) -> tuple[int, Any]:
        try:
            definition = decode(body, _SERVICE)
            for check in [definition.get("Check"), *(definition.get("Checks") or [])]:
                for key in ("Interval", "Timeout", "DeregisterCriticalServiceAfter"):
                    if check and check.get(key):
                        duration(check[key])
        except DecodeError as exc:
            return 400, f"Request decode failed: {exc}"
        if not definition.get("Name"):
            return 400, "Missing service name"
        definition.setdefault("ID", definition["Name"])
        with self._changed:
            self.services[definition["ID"]] = Registered(definition, self.index + 1)
            sidecar = (definition.get("Connect") or {}).get("SidecarService")
            if sidecar is not None:
                proxy = {
                    **(sidecar.get("Proxy") or {}),
                    "DestinationServiceName": definition["Name"],
                    "DestinationServiceID": definition["ID"],
                    "LocalServicePort": definition.get("Port"),
                }
                sidecar_id = f"{definition['ID']}-sidecar-proxy"
                self.services[sidecar_id] = Registered(
                    {"ID": sidecar_id, "Name": f"{definition['Name']}-sidecar-proxy",
                     "Kind": "connect-proxy", "Port": sidecar.get("Port") or 21000,
                     "Address": definition.get("Address", ""), "Proxy": proxy},
                    self.index + 1,
                    status="passing",
                )  # fmt: skip
            self._bump()
        return 200, None

    def _deregister(self, service_id: str) -> tuple[int, Any]:
        with self._changed:
            if service_id not in self.services:
                unknown = f'Unknown service ID "{service_id}". Ensure that the service ID '
                return 404, unknown + "is passed, not the service name."
            del self.services[service_id]
            self.services.pop(f"{service_id}-sidecar-proxy", None)
            self._bump()
        return 200, None

    def _entry(self, service_id: str, registered: Registered) -> dict[str, Any]:
        d = registered.definition
        serf = {"Node": NODE["Node"], "CheckID": "serfHealth", "Name": "Serf Health Status",
                "Status": "passing", "ServiceID": "", "ServiceName": "", "Type": ""}  # fmt: skip
        checks = [serf]
        if registered.check is not None:
            kind = "grpc" if registered.check.get("GRPC") else "http"
            checks.append({
                "Node": NODE["Node"], "CheckID": f"service:{service_id}",
                "Name": f"Service '{d['Name']}' check", "Status": registered.status,
                "Output": registered.output, "ServiceID": service_id,
                "ServiceName": d["Name"], "ServiceTags": d.get("Tags") or [], "Type": kind,
            })  # fmt: skip
        return {
            "Node": NODE,
            "Service": {
                "ID": service_id, "Service": d["Name"], "Kind": d.get("Kind", ""),
                "Tags": d.get("Tags") or [], "Address": d.get("Address", ""),
                "Meta": d.get("Meta") or {}, "Port": d.get("Port", 0),
                "Weights": {"Passing": 1, "Warning": 1}, "EnableTagOverride": False,
                "Proxy": d.get("Proxy") or {}, "Connect": {},
                "CreateIndex": registered.index, "ModifyIndex": registered.index,
            },
            "Checks": checks,
        }  # fmt: skip

    def _health(self, name: str, query: dict[str, list[str]]) -> tuple[int, Any, int]:
        try:
            wait = min(duration(query["wait"][0]), 600.0) if "wait" in query else 300.0
            index = int(query.get("index", ["0"])[0])
        except (DecodeError, ValueError) as exc:
            return 400, str(exc), self.index
        tags = query.get("tag", [])
        passing = "passing" in query and query["passing"][0] not in ("0", "false")
        deadline = time.monotonic() + wait
        with self._changed:
            while index and self.index <= index and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            entries = [
                self._entry(service_id, registered)
                for service_id, registered in sorted(self.services.items())
                if registered.definition["Name"] == name
                and all(tag in (registered.definition.get("Tags") or []) for tag in tags)
                and not (passing and registered.status != "passing")
            ]
            return 200, entries, self.index

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _answer(self, status: int, body: Any, index: int | None = None) -> None:
                payload = b"" if body is None else (
                    body.encode() if isinstance(body, str) else json.dumps(body).encode()
                )  # fmt: skip
                kind = "text/plain" if isinstance(body, str) else "application/json"
                # A watcher that stopped waiting (a stage shutting down) has hung up on its
                # blocking query: the agent drops the answer, and so does the double.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    if index is not None:
                        self.send_header("X-Consul-Index", str(index))
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)

            def _handle(self, method: str) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query, keep_blank_values=True)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except json.JSONDecodeError as exc:
                    return self._answer(400, f"Request decode failed: {exc}")
                headers = {k.lower(): v for k, v in self.headers.items()}
                double.requests.append(Request(method, url.path, query, headers, body))
                token = headers.get("x-consul-token") or query.get("token", [""])[0]
                if double.token and token != double.token:
                    return self._answer(403, "ACL not found" if token else "Permission denied")
                if method == "PUT" and url.path == "/v1/agent/service/register":
                    return self._answer(*double._register(body, query))
                prefix = "/v1/agent/service/deregister/"
                if method == "PUT" and url.path.startswith(prefix):
                    return self._answer(*double._deregister(url.path[len(prefix) :]))
                prefix = "/v1/health/service/"
                if method == "GET" and url.path.startswith(prefix):
                    return self._answer(*double._health(url.path[len(prefix) :], query))
                return self._answer(404, "not found")

            def do_GET(self) -> None:
                self._handle("GET")

            def do_PUT(self) -> None:
                self._handle("PUT")

        return Handler

    # The agent's check runner.

    def _run_checks(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._changed:
                due = [(service_id, r) for service_id, r in self.services.items()
                       if r.check is not None and r.next_check <= now]  # fmt: skip
            for service_id, registered in due:
                check = registered.check
                registered.next_check = now + duration(check["Interval"])
                ok, output = self._probe(check)
                with self._changed:
                    if self.services.get(service_id) is not registered:
                        continue
                    status = "passing" if ok else "critical"
                    registered.output = output
                    if status != registered.status:
                        registered.status = status
                        registered.critical_since = time.monotonic()
                        self.transitions.append((registered.definition["Name"], status, output))
                        self._bump()
                    after = check.get("DeregisterCriticalServiceAfter")
                    if (
                        status == "critical"
                        and after
                        and time.monotonic() - registered.critical_since >= duration(after)
                    ):
                        del self.services[service_id]
                        self.services.pop(f"{service_id}-sidecar-proxy", None)
                        self._bump()  # fmt: skip

    @staticmethod
    def _probe(check: dict[str, Any]) -> tuple[bool, str]:
        timeout = duration(check["Timeout"]) if check.get("Timeout") else 10.0
        if check.get("GRPC"):
            target, _, service = check["GRPC"].partition("/")
            ok = check_health(target, service, timeout=timeout)
            return ok, "gRPC check: " + ("SERVING" if ok else "not serving")
        try:
            with urllib.request.urlopen(check["HTTP"], timeout=timeout) as response:
                return 200 <= response.status < 300, f"HTTP GET: {response.status}"
        except (urllib.error.URLError, OSError) as exc:
            return False, f"HTTP GET: {exc}"
