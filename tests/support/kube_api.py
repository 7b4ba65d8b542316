"""A fake of the Kubernetes API server's EndpointSlice resource, for the tests of the
Kubernetes registry (no cluster runs here). It speaks the real JSON and protocol:

- `GET /apis/discovery.k8s.io/v1/namespaces/<ns>/endpointslices?labelSelector=K=V`
  answers an `EndpointSliceList` with the list's `resourceVersion`;
- with `watch=1&resourceVersion=N` it streams, chunked, one JSON event per line (ADDED,
  MODIFIED, DELETED, ERROR) for every change after N, until `timeoutSeconds` or an ERROR
  (a 410 Status where the watch expired), as the API server does.

Slices are set with `put` and `delete`; `expire_watches` ends every watch with 410.
Every request's query is recorded (`requests`).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

SERVICE_LABEL = "kubernetes.io/service-name"


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


_EXPIRED = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": "too old resource version",
    "reason": "Expired",
    "code": 410,
}


class KubeApi:
    def __init__(self, namespace: str = "mesh") -> None:
        self.namespace = namespace
        self.version = 1
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.requests: list[dict[str, str]] = []
        self._changed = threading.Condition()
        self._closed = False
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

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

    def _selected(self, item: dict[str, Any], selector: str) -> bool:
        key, _, value = selector.partition("=")
        labels = item["metadata"].get("labels", {})
        return item["kind"] == "Status" or labels.get(key) == value

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self
        path = f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _json(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = dict(parse_qsl(url.query))
                api.requests.append(query)
                if url.path != path:
                    self._json(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
                    return
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
                        api._changed.wait_for(
                            lambda sent=sent: api._closed or api.version > sent,
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
