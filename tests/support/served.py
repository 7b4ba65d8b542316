"""`prism serve` in a subprocess, as a user runs it, and a load of streamed chats on it."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

from prism.ops.stage_process import http_ok
from prism.runtime.ports import free_port
from support import metrics
from support.content import data_url, image_part, png, user
from support.meshes import stream_outcome
from support.waiting import wait_for


class Served:
    """`prism serve` in a subprocess, its output in `log`."""

    def __init__(self, args: list[str], tmp: Path) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.status_file, self.log = tmp / "status.json", tmp / "serve.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "prism.cli", "--log-level", "warning", "serve",
                 "--http-port", str(self.port), "--status-file", str(self.status_file),
                 *args],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        assert wait_for(self.status_file.exists, timeout=300), self.tail()
        self.status = json.loads(self.status_file.read_text())
        self.model = self.status["model"]

    def stop(self) -> int:
        """SIGTERM, as a user's Ctrl-C; its exit code."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stage(self, name: str) -> dict:
        return next(s for s in self.status["stages"] if s["name"] == name)

    def pid(self, name: str) -> int | None:
        """The stage's process: the one `prism serve` started (spawned, or forked from its
        stage template) to listen on its port."""
        port = self.port if name == "gateway" else self.stage(name)["address"].split(":")[1]
        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                # A forked stage's command line reads as one string (prism.ops.template).
                argv = " ".join(child.cmdline()).split()
                if "--port" in argv and argv[argv.index("--port") + 1] == str(port):
                    return child.pid
        return None

    def gauge(self, stage: str, name: str) -> float:
        return metrics.total(self.stage(stage)["metrics"], name)

    def healthy(self) -> bool:
        return http_ok(f"{self.base_url}/health")

    def answers(self) -> bool:
        # With an image: every stage of the mode takes part.
        parts = [image_part(data_url(png(7))), "Are you back?"]
        body = {"model": self.model, "messages": user(*parts), "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        return stream_outcome(f"{self.base_url}/v1", body, timeout=30) == "completed"


class Load:
    """Streamed chats, `clients` at a time, each `pause_s` after its last answer (as a
    user reads it), until stopped; how each ended."""

    def __init__(self, served: Served, clients: int = 4, pause_s: float = 0.0) -> None:
        self.served = served
        self.pause_s = pause_s
        self.outcomes: Counter[str] = Counter()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, index: int) -> None:
        sent = 0
        while not self._stop.is_set():
            parts = [image_part(data_url(png(index * 1000 + sent)))] if sent % 2 else []
            body = {"model": self.served.model, "messages": user(*parts, "Tell me more."),
                    "max_tokens": 8}  # fmt: skip
            outcome = stream_outcome(f"{self.served.base_url}/v1", body, timeout=60)
            # A connection refused while the gateway is down; not a hang.
            if outcome.startswith("dropped") and "Timeout" not in outcome:
                outcome = "refused"
            if outcome != "completed":
                # As a client backs off; one that did not would only load the machine.
                time.sleep(0.2)
            self._stop.wait(self.pause_s)
            self.outcomes[outcome.split(":")[0]] += 1
            sent += 1

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc: object) -> None:
        # A test that failed midway leaves no client sending behind it.
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def stop(self) -> Counter[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self._threads), "a client hangs"
        return self.outcomes
