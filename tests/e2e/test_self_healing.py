"""`prism serve` heals itself: each kind of stage SIGKILLed under load is started again at
its address, /health drops while a stage the mode needs is down and returns when it is
back, the mesh answers again without a hand, nothing hangs, and every gauge returns to
zero. E/P/D and EP/D on vLLM (prefill and decode engines restart for real, and answer as
offline vLLM does after each restart; the front: processor and REST API in one process);
E/PD on simulated workers for the rest of the stages, with the gateway apart
(`--front split`)."""

from __future__ import annotations

import signal
import threading
import time
import types

import psutil
import pytest
from support.cases import CASES as PARITY_CASES
from support.cases import ask_case
from support.served import Load, Served
from support.waiting import wait_for

# How long a killed stage may take to be back: vLLM's start on a loaded 2-core machine.
RECOVERY_S = 240


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
    "e-p-d-vllm": ("e/p/d", [], ["encoder-0", "front", "prefill-0", "decode-0"],
                   {"front", "prefill-0", "decode-0"}),
    "ep-d-vllm": ("ep/d", [], ["prefill-0", "decode-0"], {"prefill-0", "decode-0"}),
    "e-pd-sim": ("e/pd", ["--engine", "sim", "--front", "split"],
                 ["encoder-0", "processor", "worker-0", "gateway"], {"processor", "gateway"}),
}  # fmt: skip


def assert_answers_as_offline_vllm(served: Served, expected: dict[str, dict]) -> None:
    """Greedy answers, with an image and without, equal offline vLLM's."""
    mesh = types.SimpleNamespace(base_url=f"{served.base_url}/v1", model=served.model)
    for case in ("one_image", "text_only"):
        text, _ = ask_case(mesh, PARITY_CASES[case], stream=True)
        assert text == expected[case]["text"], case


@pytest.mark.parametrize("case", list(CASES))
def test_each_stage_killed_under_load_is_restarted_and_the_mesh_serves_again(
    models, oracle, tmp_path, case
):
    mode, flags, victims, seen_down = CASES[case]
    # Real engines answer as offline vLLM does, after every recovery as before.
    expected = oracle("llava") if case.endswith("-vllm") else None
    served = Served(["--mode", mode, "--model", str(models["llava"]), *flags], tmp_path)
    gauges = []
    try:
        assert served.answers(), served.tail()
        with Load(served) as load:
            recovered = {}
            for name in victims:
                recovered[name] = kill_and_recover(served, name, name in seen_down)
                if expected is not None:
                    assert_answers_as_offline_vllm(served, expected)
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
