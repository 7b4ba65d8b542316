"""`prism serve` heals itself: each kind of stage SIGKILLed under load is started again at
its address, /health drops while a stage the mode needs is down and returns when it is
back, the mesh answers again without a hand, nothing hangs, and every gauge returns to
zero. E/P/D on vLLM (a decode engine restarts for real, and the front: processor and
REST API in one process); E/PD on simulated workers for the rest of the stages, with the
gateway apart (`--front split`)."""

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
import pytest
from conftest import stream_outcome
from support import metrics
from support.content import data_url, image_part, png, user
from support.waiting import wait_for

from prism.ops.stage_process import http_ok
from prism.runtime.ports import free_port

# How long a killed stage may take to be back: vLLM's start on a loaded 2-core machine.
RECOVERY_S = 240


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

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stage(self, name: str) -> dict:
        return next(s for s in self.status["stages"] if s["name"] == name)

    def pid(self, name: str) -> int | None:
        """The stage's process: the child of `prism serve` that listens on its port."""
        port = self.port if name == "gateway" else self.stage(name)["address"].split(":")[1]
        for child in psutil.Process(self.process.pid).children():
            with contextlib.suppress(psutil.Error):
                argv = child.cmdline()
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
    """Streamed chats, `clients` at a time, until stopped; how each ended."""

    def __init__(self, served: Served, clients: int = 4) -> None:
        self.served = served
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
            self.outcomes[outcome.split(":")[0]] += 1
            sent += 1

    def stop(self) -> Counter[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self._threads), "a client hangs"
        return self.outcomes


class HealthWatch:
    """Whether /health said anything but 200 since `start`."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.dropped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            if not self.served.healthy():
                self.dropped = True

    def stop(self) -> bool:
        self._stop.set()
        self._thread.join()
        return self.dropped


def kill_and_recover(served: Served, name: str, must_drop: bool) -> float:
    """SIGKILLs the stage `name`; the seconds until the mesh answered again."""
    pid = served.pid(name)
    assert pid is not None
    watch = HealthWatch(served)
    killed = time.monotonic()
    psutil.Process(pid).send_signal(signal.SIGKILL)
    restarting = f"{name} exited (SIGKILL); restarting"
    assert wait_for(lambda: restarting in served.tail(200), timeout=10), served.tail()
    assert wait_for(lambda: served.pid(name) not in (None, pid), timeout=60), served.tail()
    back = f"{name} is serving again"
    assert wait_for(lambda: back in served.tail(200), RECOVERY_S), served.tail()
    assert wait_for(lambda: served.healthy() and served.answers(), 60, 1), (
        f"{name}: the mesh did not answer again\n{served.tail()}"
    )
    recovered = round(time.monotonic() - killed, 1)
    assert watch.stop() or not must_drop, f"/health never dropped while {name} was down"
    return recovered


CASES = {
    # mode, its flags, the stages killed one at a time, those /health must be seen down for
    "e-p-d-vllm": ("e/p/d", [], ["encoder-0", "front", "decode-0"], {"front", "decode-0"}),
    "e-pd-sim": ("e/pd", ["--engine", "sim", "--front", "split"],
                 ["encoder-0", "processor", "worker-0", "gateway"], {"processor", "gateway"}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_stage_killed_under_load_is_restarted_and_the_mesh_serves_again(
    models, tmp_path, case
):
    mode, flags, victims, seen_down = CASES[case]
    served = Served(["--mode", mode, "--model", str(models["llava"]), *flags], tmp_path)
    gauges = []
    try:
        assert served.answers(), served.tail()
        load = Load(served)
        recovered = {name: kill_and_recover(served, name, name in seen_down) for name in victims}
        outcomes = load.stop()
        print(f"{case}: back after {recovered} s; load: {dict(outcomes)}")
        assert served.process.poll() is None
        assert outcomes["completed"] > 0, outcomes
        # Errors while a stage was down are clean (an OpenAI error body or a refused
        # connection), never a hang or a broken stream.
        assert not [o for o in outcomes if o not in ("completed", "refused")
                    and not o.startswith("error ")], outcomes  # fmt: skip
        roles = {s["name"]: s["role"] for s in served.status["stages"]}
        gauges = [
            (name, "prism_engine_requests_in_flight" if role in ("worker", "prefill", "decode")
             else "prism_requests_in_flight")
            for name, role in roles.items() if role != "encoder"
        ]  # fmt: skip
        # Unread embeddings wait out their 30 s lease at most.
        assert wait_for(lambda: not any(served.gauge(*g) for g in gauges), timeout=45), [
            (g, served.gauge(*g)) for g in gauges
        ]
    finally:
        descendants = psutil.Process(served.process.pid).children(recursive=True)
        served.process.send_signal(signal.SIGTERM)
        code = served.process.wait(timeout=120)
        _, alive = psutil.wait_procs(descendants, timeout=30)
    assert code == 0, served.tail()
    assert not alive, [p.pid for p in alive]
