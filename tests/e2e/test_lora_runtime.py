"""An adapter loaded at run time belongs to the mesh, not to one process: `prism serve`
(EPD, two vLLM workers, two fronts sharing their ports) loads it on both engines through
whichever front takes the load; every front serves it, a worker SIGKILLed and started
again by the mesh serves it (loading it from the requests that name it), and so does a
front started again (from the mesh's adapter file); every answer is offline vLLM's with
that adapter. Unloaded through one front, it is a 404 at every front."""

from __future__ import annotations

import contextlib
import shutil
import signal
from collections.abc import Callable
from urllib.parse import urlparse

import httpx
import psutil
from support.cases import LORA_CASES
from support.meshes import LORA_FLAGS
from support.served import Served
from support.waiting import wait_for

FRONTS = ("front-0", "front-1")
WORKERS = ("worker-0", "worker-1")
# vLLM's start on a loaded 2-core machine.
RESTART_S = 240


def pid(served: Served, name: str) -> int | None:
    """The process of stage `name`, by its own metrics port (fronts share the others)."""
    port = str(urlparse(served.stage(name)["metrics"]).port)
    for child in psutil.Process(served.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            # A forked stage's command line reads as one string (prism.ops.template).
            argv = " ".join(child.cmdline()).split()
            if "--metrics-port" in argv and argv[argv.index("--metrics-port") + 1] == port:
                return child.pid
    return None


def restart(served: Served, name: str) -> None:
    """SIGKILLs stage `name` and waits until the mesh has started it again."""
    killed = pid(served, name)
    assert killed is not None
    psutil.Process(killed).send_signal(signal.SIGKILL)
    back = f"{name} is serving again"
    assert wait_for(lambda: back in served.tail(400), RESTART_S), served.tail()
    assert pid(served, name) not in (None, killed)


def test_an_adapter_loaded_at_run_time_is_the_meshs_through_restarts(
    models, adapters, oracle, tmp_path
):
    source = adapters["llava"]["a2"]
    copy = source.parent / "llava-runtime-b2"
    shutil.copytree(source, copy, dirs_exist_ok=True)
    expected = oracle("llava")["lora_a2_0"]["text"]
    _, messages, max_tokens, _ = LORA_CASES["lora_a2_0"]
    served = Served(["--mode", "epd", "--workers", "2", "--front-workers", "2",
                     "--model", str(models["llava"]), *LORA_FLAGS,
                     "--allowed-lora-dirs", str(source.parent)], tmp_path)  # fmt: skip
    url = f"{served.base_url}/v1"
    body = {"model": "b2", "messages": messages, "max_tokens": max_tokens, "temperature": 0}

    def post(path: str, json: dict) -> httpx.Response:
        # A connection of its own each: the kernel picks the front.
        return httpx.post(f"{url}/{path}", json=json, timeout=120)

    def answered(front: str) -> float:
        return served.gauge(front, "prism_lora_requests_total")

    def answers_until(done: Callable[[], bool]) -> None:
        """Asks for the adapter, every answer the adapter's, until `done()` (the kernel
        spreads the connections over the fronts, each front its calls over the workers)."""
        for _ in range(64):
            reply = post("chat/completions", body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == expected
            if done():
                return
        raise AssertionError("never done")

    try:
        loaded = post("load_lora_adapter", {"lora_name": "b2", "lora_path": str(copy)})
        assert loaded.status_code == 200, loaded.text
        assert {served.gauge(w, "prism_engine_lora_adapters") for w in WORKERS} == {1}
        answers_until(lambda: all(answered(front) for front in FRONTS))
        restart(served, "worker-0")
        assert served.gauge("worker-0", "prism_engine_lora_adapters") == 0
        # The restarted worker loads it from a request that names it.
        answers_until(lambda: served.gauge("worker-0", "prism_engine_lora_adapters") == 1)
        restart(served, "front-0")
        answers_until(lambda: answered("front-0") > 0)
        unloaded = post("unload_lora_adapter", {"lora_name": "b2"})
        assert unloaded.status_code == 200, unloaded.text
        gone = [post("chat/completions", body) for _ in range(8)]
        assert {reply.status_code for reply in gone} == {404}
        assert all("b2" in reply.json()["error"]["message"] for reply in gone)
    finally:
        descendants = psutil.Process(served.process.pid).children(recursive=True)
        code = served.stop()
        _, alive = psutil.wait_procs(descendants, timeout=30)
    assert code == 0, served.tail()
    assert not alive, [p.pid for p in alive]
