"""Replicas behind the Consul registry: real processes, registered with the Consul double
(tests/support/consul_double.py: no Consul binary can be installed here), routed among by the
processor, and a replica lost to SIGKILL taken out of rotation."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import openai
from support.cases import CONCURRENT_CASES, ask_case, assert_answers_differ
from support.consul_double import ConsulDouble
from support.content import data_url, png, user
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.config.registry import RegistryConfig

TOKEN = "consul-acl-secret"


def served(mesh, stage: str) -> float:
    """Requests the vLLM engine of `stage` has finished."""
    return sum(
        v for k, v in mesh.metrics(stage).items() if k.startswith("vllm:request_success_total")
    )


def answers_equal_offline_vllms_at_concurrency(mesh, expected: dict[str, dict]) -> None:
    """Concurrent requests spread over both workers: each answer is offline vLLM's to
    its own prompt, and no two are alike, so that answers crossing between requests or
    replicas show."""
    names = list(CONCURRENT_CASES)[:24]
    assert_answers_differ(expected, names)
    with ThreadPoolExecutor(8) as pool:
        answers = pool.map(lambda name: ask_case(mesh, CONCURRENT_CASES[name], stream=True), names)
        wrong = {name: text for name, (text, _) in zip(names, answers, strict=True)
                 if text != expected[name]["text"]}  # fmt: skip
    assert not wrong, wrong


def test_requests_spread_over_two_workers_and_survive_losing_one(models, oracle, tmp_path):
    # With an ACL token: the double refuses a stage that does not present it.
    with ConsulDouble(token=TOKEN) as consul:
        registry = RegistryConfig(consul.url, consul_token=TOKEN, consul_check_interval="500ms")
        mesh = start_mesh("llava", "epd", models["llava"], tmp_path, workers=2,
                          registry=registry)  # fmt: skip
        try:
            # Every stage has the token from its environment; none shows it to `ps`.
            for stage in mesh.mesh.stages:
                with open(f"/proc/{stage.process.pid}/cmdline", "rb") as cmdline:
                    assert TOKEN.encode() not in cmdline.read(), stage.name
            # Every stage registered itself, and Consul's checks pass for all of them.
            names = sorted(r.definition["Name"] for r in consul.services.values())
            assert names == ["prism-gateway", "prism-processor", "prism-worker", "prism-worker"]
            # The mesh is up once one worker is: the second may pass its check a moment later.
            assert wait_for(lambda: len(consul.passing("prism-worker")) == 2)
            client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
            image = data_url(png(3))

            def ask(i: int) -> None:
                reply = client.chat.completions.create(
                    model=mesh.model,
                    messages=user(f"Picture {i}?", {"type": "image_url",
                                                    "image_url": {"url": image}}),
                    max_tokens=4,
                    temperature=0,
                )  # fmt: skip
                assert reply.choices[0].finish_reason in ("length", "stop")

            workers = ["worker-0", "worker-1"]
            # Until the processor has found both (it follows Consul's changes).
            assert wait_for(lambda: ask(0) or all(served(mesh, w) for w in workers))
            answers_equal_offline_vllms_at_concurrency(mesh, oracle("llava"))
            before = [served(mesh, w) for w in workers]
            for i in range(20):
                ask(i)
            assert [served(mesh, w) - b for w, b in zip(workers, before, strict=True)] == [10, 10]

            os.killpg(mesh.mesh.stage("worker-1").process.pid, signal.SIGKILL)
            for i in range(6):
                ask(i)
            assert served(mesh, "worker-0") == before[0] + 16
            # Consul's check found it gone too.
            assert wait_for(lambda: len(consul.passing("prism-worker")) == 1)
        finally:
            mesh.stop()
        # Every stage that stopped gracefully deregistered itself.
        assert [r.definition["Name"] for r in consul.services.values()] == ["prism-worker"]
