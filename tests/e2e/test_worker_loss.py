"""Workers lost mid-stream, on meshes of real processes: the request moves to another
replica and continues from the tokens already streamed; under a storm of requests and
disconnects nothing hangs and nothing is left held."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter

import httpx
import psutil
import pytest
from support.cases import run_oracle
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.rpc.channel import check_health


def messages(image: bool) -> list[dict]:
    return user("Tell me more.", *([image_part(data_url(png(71)))] if image else []))


def long_chat(mesh, max_tokens: int, image: bool = False) -> dict:
    return {"model": mesh.model, "messages": messages(image), "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip


def in_flight(mesh, stage: str) -> float:
    return mesh.metrics(stage)["prism_engine_requests_in_flight"]


def test_a_worker_killed_mid_stream_hands_the_request_to_another(models, tmp_path):
    # Simulated engines: what moves the request is the mesh's, not the model's.
    mesh = start_mesh("llava", "epd", models["llava"], tmp_path, workers=2, engine="sim")
    try:
        chunks: list[str] = []
        with httpx.stream("POST", f"{mesh.base_url}/chat/completions",
                          json=long_chat(mesh, 400), timeout=120) as reply:  # fmt: skip
            lines = reply.iter_lines()
            while len(chunks) < 20:
                line = next(lines)
                if line.startswith("data: {"):
                    chunks.append(line)
            (serving,) = [w for w in ("worker-0", "worker-1") if in_flight(mesh, w) == 1]
            # The whole worker, engine processes included, as when its machine is lost.
            os.killpg(mesh.mesh.stage(serving).process.pid, signal.SIGKILL)
            chunks += [line for line in lines if line.startswith("data: {")]
        events = [json.loads(chunk[len("data: ") :]) for chunk in chunks]
        errors = [e for e in events if "error" in e]
        assert not errors, f"{errors}\n{mesh.log_problems()}"
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        # Every token arrived once: 400 in all, the prompt as the client sent it.
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 400
        survivor = "worker-1" if serving == "worker-0" else "worker-0"
        assert wait_for(lambda: in_flight(mesh, survivor) == 0)
        short = {**long_chat(mesh, 2), "stream": False}
        again = httpx.post(f"{mesh.base_url}/chat/completions", json=short, timeout=60).json()
        assert usage["prompt_tokens"] == again["usage"]["prompt_tokens"]
    finally:
        mesh.stop()


# mode, the replicas it needs, the stages that may be streaming the request
MIGRATIONS = {
    "epd": ({"workers": 2}, ("worker-0", "worker-1")),
    "e-p-d": ({"decode_workers": 2}, ("decode-0", "decode-1")),
}


@pytest.mark.parametrize("mode", list(MIGRATIONS))
def test_a_request_migrated_from_a_killed_vllm_engine_ends_as_offline_vllm_would(
    models, tmp_path, mode
):
    """Greedy, on vLLM, with an image: the aggregated worker (EPD) or the decode (E/P/D)
    streaming the request is SIGKILLed mid-stream; another resumes from the prompt plus
    the tokens streamed (in E/P/D, prefilled again with the image's embeddings), and the
    whole answer is offline vLLM's, token for token."""
    replicas, stages = MIGRATIONS[mode]
    case = ("chat", messages(image=True), 160, {"ignore_eos": True})
    expected = run_oracle(models["llava"], tmp_path, {"long": case})["long"]
    mesh = start_mesh("llava", mode.replace("-", "/"), models["llava"], tmp_path, **replicas)
    try:
        body = long_chat(mesh, 160, image=True)
        events = []
        with httpx.stream("POST", f"{mesh.base_url}/chat/completions", json=body,
                          timeout=120) as reply:  # fmt: skip
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 10:
                    (serving,) = [s for s in stages if in_flight(mesh, s)]
                    os.killpg(mesh.mesh.stage(serving).process.pid, signal.SIGKILL)
        assert not [e for e in events if "error" in e], mesh.log_problems()
        assert "resuming elsewhere" in mesh.log_path.read_text()
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert text == expected["text"]
        assert events[-1]["usage"]["completion_tokens"] == len(expected["token_ids"]) == 160
    finally:
        mesh.stop()


def test_chaos_in_e_p_d_leaves_nothing_hung_or_held(models, tmp_path):
    """300 streaming requests, 16 at a time; a tenth of the clients hang up at a random
    point; one of the two decode workers (its whole process group) is SIGKILLed after the
    first 90. At most 1 % end in an error: the killed decode's requests move to the other.
    Every request is greedy: each that completed is offline vLLM's answer to its prompt."""
    oracle = run_oracle(models["llava"], tmp_path, {
        str(image): ("chat", messages(image), 16, {"ignore_eos": True}) for image in (False, True)
    })  # fmt: skip
    expected = {image: oracle[str(image)]["text"] for image in (False, True)}
    assert expected[True] != expected[False]
    mesh = start_mesh("llava", "e/p/d", models["llava"], tmp_path, decode_workers=2)
    rng = random.Random(7)
    count = 300
    plan = [(i % 3 == 0, rng.random() < 0.1, rng.randint(1, 10)) for i in range(count)]
    outcomes: Counter[str] = Counter()
    # Clients that meant to hang up but whose answer came whole first: its tokens may come
    # in fewer events than `after` (events ready together travel as one, as after a
    # request moved to the other decode).
    answered_first: list[bool] = []
    done = threading.Event()
    lock = threading.Lock()

    def client(image: bool, hang_up: bool, after: int) -> None:
        outcome = "no answer"
        try:
            with httpx.stream("POST", f"{mesh.base_url}/chat/completions",
                              json=long_chat(mesh, 16, image), timeout=60) as reply:  # fmt: skip
                if reply.status_code != 200:
                    outcome = (
                        f"http {reply.status_code} " + json.loads(reply.read())["error"]["code"]
                    )
                    return
                events, text = 0, ""
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        outcome = "error " + event["error"]["code"]
                        return
                    events += 1
                    text += "".join(c["delta"].get("content") or "" for c in event["choices"])
                    if hang_up and events >= after:
                        outcome = "hung up"
                        return
                    if event.get("usage") and event["usage"]["completion_tokens"] == 16:
                        outcome = "completed" if text == expected[image] else "wrong text"
        except httpx.TimeoutException:
            outcome = "timed out"
        finally:
            with lock:
                outcomes[outcome] += 1
                if hang_up and outcome == "completed":
                    answered_first.append(True)
                if sum(outcomes.values()) >= 90:
                    done.set()

    def kill_a_decode() -> None:
        done.wait(timeout=300)
        os.killpg(mesh.mesh.stage("decode-1").process.pid, signal.SIGKILL)

    try:
        killer = threading.Thread(target=kill_a_decode)
        killer.start()
        started = time.monotonic()
        threads: list[threading.Thread] = []
        for args in plan:
            while sum(t.is_alive() for t in threads) >= 16:
                time.sleep(0.01)
            threads.append(threading.Thread(target=client, args=args))
            threads[-1].start()
        for thread in threads:
            thread.join(timeout=120)
        killer.join(timeout=10)
        print(f"chaos: {dict(outcomes)} in {time.monotonic() - started:.0f} s")
        # Shown only if the test fails.
        print(mesh.log_problems())
        assert sum(outcomes.values()) == count, outcomes
        # Every request completed, was hung up on, or ended with a clean error, rarely.
        clean = {"completed", "hung up"}
        assert not [o for o in outcomes if o not in clean and not o.startswith(("http ", "error "))]
        planned = sum(hang for _, hang, _ in plan)
        assert outcomes["hung up"] + len(answered_first) == planned, outcomes
        assert outcomes["completed"] + outcomes["hung up"] >= count * 0.99, outcomes

        def idle() -> bool:
            held = [
                mesh.metric("encoder", "prism_nixl_pool_bytes_in_use"),
                mesh.metric("prefill", "prism_nixl_pool_bytes_in_use"),
                *(
                    mesh.metric(e, "prism_engine_requests_in_flight")
                    for e in ("prefill", "decode-0")
                ),
                *(mesh.metric(e, "vllm:kv_cache_usage_perc") for e in ("prefill", "decode-0")),
                mesh.metric("front", "prism_requests_in_flight"),
            ]
            return not any(held)

        # Unread embeddings wait out their 30 s lease at most.
        assert wait_for(idle, timeout=45)
    finally:
        mesh.stop()


def engine_core(mesh, stage: str) -> psutil.Process:
    (core,) = [
        child
        for child in psutil.Process(mesh.mesh.stage(stage).process.pid).children(recursive=True)
        if child.name() == "VLLM::EngineCore"
    ]
    return core


def test_a_worker_whose_engine_cannot_generate_reports_not_serving(models, tmp_path):
    """Its health follows the engine: NOT_SERVING while the engine is wedged (stopped),
    SERVING again once it generates; once the engine is dead, NOT_SERVING, and the worker
    drains and exits with an error, to be started again by its supervisor."""
    mesh = start_mesh("llava", "epd", models["llava"], tmp_path)
    worker = mesh.address("worker")

    def serving() -> bool:
        return check_health(worker)

    try:
        assert serving()
        core = engine_core(mesh, "worker")
        core.suspend()
        # A canary after 10 s without output, which fails after 5 s.
        assert wait_for(lambda: not serving(), timeout=30), mesh.log_tail()
        core.resume()
        assert wait_for(serving, timeout=30), mesh.log_tail()
        core.kill()
        assert wait_for(lambda: not serving(), timeout=15), mesh.log_tail()
        process = mesh.mesh.stage("worker").process
        assert process.wait(timeout=60) == 1
        assert "exiting: worker: its vLLM engine core died" in mesh.log_tail()
    finally:
        mesh.stop()
