"""The fixtures the lanes share, a pytest plugin (tests/conftest.py's `pytest_plugins`):
tiny models, the offline-vLLM oracle, `vllm serve`'s answers, a loopback image server, and
one running mesh per family and mode. Engines are expensive, so everything that starts one
is session-scoped and shared: one shared mesh runs at a time. Tests that start meshes of
their own may run beside it, since an idle mesh takes no CPU (`e2e/test_idle.py`)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from prism.modes import MODES
from support import parity
from support.cases import (
    ADAPTERS,
    CONCURRENT_CASES,
    FAMILIES,
    LORA_CASES,
    SEEDED_CASES,
    cases,
    run_oracle,
)
from support.meshes import (
    ALLOWED_HOST,
    LORA_RANK,
    close_template,
    first_requests,
    start_mesh,
)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # Here, not at the top: building imports torch, which the unit lane never loads.
    from prism.devtools.tiny_models import build

    root = tmp_path_factory.mktemp("models")
    return {family: build(family, root / family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def adapters(models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """The LoRA adapters of each family's model, by name (random, each of its own seed)."""
    from prism.devtools.lora import build_lora

    root = tmp_path_factory.mktemp("adapters")
    return {
        family: {name: build_lora(model, root / f"{family}-{name}", rank=LORA_RANK, seed=seed)
                 for seed, name in enumerate(ADAPTERS, 1)}
        for family, model in models.items()
    }  # fmt: skip


@pytest.fixture(scope="session")
def oracle(models, adapters, tmp_path_factory):
    """oracle(family) -> {case name: {text, token_ids, prompt_tokens, finish_reason}}."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict[str, dict]:
        if family not in cache:
            tmp = tmp_path_factory.mktemp(f"o-{family}")
            named = cases(family) | CONCURRENT_CASES | SEEDED_CASES | LORA_CASES
            cache[family] = run_oracle(models[family], tmp, named, adapters[family])
        return cache[family]

    return get


@pytest.fixture(scope="session")
def served(models, tmp_path_factory):
    """served(family) -> {parity case name: `vllm serve`'s answer} (tests/support/parity.py)."""
    cache: dict[str, dict] = {}

    def get(family: str) -> dict[str, dict]:
        if family not in cache:
            log = tmp_path_factory.mktemp(f"served-{family}") / "vllm-serve.log"
            cache[family] = parity.reference(str(models[family]), log)
        return cache[family]

    return get


MESHES = [(family, mode) for family in FAMILIES for mode in MODES]


@pytest.fixture(
    scope="session", params=MESHES, ids=[f"{f}-{m.replace('/', '-')}" for f, m in MESHES]
)
def mesh(request, models, adapters, oracle, served, tmp_path_factory):
    """A mesh per family and mode, serving the family's LoRA adapters beside its model;
    the family's oracle runs first (one engine at a time), and `vllm serve`'s answers to
    the parity cases when a parity test is to run."""
    family, mode = request.param
    oracle(family)
    parity_tests = ("test_openai_parity.py", "test_grpc_parity.py", "test_responses_parity.py",
                    "test_messages.py")  # fmt: skip
    if any(item.path.name in parity_tests for item in request.session.items):
        served(family)
    # Tool calls parsed as `vllm serve` parses them for the parity cases.
    served_adapters = [f"{name}={path}" for name, path in adapters[family].items()]
    # Adapters may be loaded at run time from where the family's are (test_lora).
    loadable = [str(path.parent) for path in adapters[family].values()][:1]
    running = start_mesh(family, mode, models[family], tmp_path_factory.mktemp("logs"),
                         tool_call_parser="hermes", enable_auto_tool_choice=True,
                         lora_modules=served_adapters, allowed_lora_dirs=loadable)  # fmt: skip
    running.first_outcomes = first_requests(running)
    yield running
    running.stop()


class _ImageHandler(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[bytes, str]]] = {}
    redirects: ClassVar[dict[str, str]] = {}

    def do_GET(self) -> None:
        if self.path in self.redirects:
            self.send_response(302)
            self.send_header("Location", self.redirects[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body, mime = self.routes.get(self.path, (b"not found", "text/plain"))
        self.send_response(200 if self.path in self.routes else 404)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="session")
def image_server():
    """A loopback HTTP server: `serve(path, body, mime)` returns the URL of that body, on
    the host name the tests' meshes allow; `serve(path, location=URL)` redirects."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(path: str, body: bytes = b"", mime: str = "image/png", location: str = "") -> str:
        if location:
            _ImageHandler.redirects[path] = location
        else:
            _ImageHandler.routes[path] = (body, mime)
        return f"http://{ALLOWED_HOST}:{server.server_port}{path}"

    yield serve
    server.shutdown()
    server.server_close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    close_template()
