"""Meshes whose stages sit on simulated hosts (tests/hosts.py): embeddings and KV cross a
real network stack (UCX over TCP between network namespaces), and the processor reaches
every stage at its host's address. Greedy output still equals offline vLLM's, and a host
cut off mid-stream loses no request."""

from __future__ import annotations

import functools
import os
import threading

import hosts
import httpx
import pytest
from conftest import CASES, data_url, png, start_mesh, stream_outcome, user, wait_for

from prism.rpc import check_health

# Not in `make test` yet: they hung a suite once, as a decode worker spun in the kernel
# while reaping its engine (launcher._reap now breaks that), and have not been run in a
# loop since.
OPT_IN = "PRISM_NET_TESTS"
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(os.environ.get(OPT_IN) != "1", reason=f"opt-in: {OPT_IN}=1 (make test-net)"),
    pytest.mark.skipif(bool(hosts.available()), reason=hosts.available() or "-"),
]


def answer(mesh, case: str) -> tuple[str, int]:
    """Text and completion tokens of one parity case, greedy, as one JSON body."""
    kind, body, max_tokens = CASES[case]
    if kind == "chat":
        path, request = "chat/completions", {"messages": body}
    else:
        path, request = "completions", {"prompt": body}
    request |= {"model": mesh.model, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{mesh.base_url}/{path}", json=request, timeout=120)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    choice = reply["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return text, reply["usage"]["completion_tokens"]


def assert_equals_offline_vllm(mesh, expected: dict[str, dict]) -> None:
    for case in CASES:
        text, tokens = answer(mesh, case)
        assert (text, tokens) == (expected[case]["text"], len(expected[case]["token_ids"])), case


def test_e_pd_across_hosts_equals_offline_vllm(models, oracle, tmp_path):
    with hosts.Hosts(["front", "encode", "work"]) as net:
        placement = {"gateway": net["front"], "processor": net["front"],
                     "encoder-0": net["encode"], "worker-0": net["work"]}  # fmt: skip
        mesh = start_mesh("llava", "e/pd", models["llava"], tmp_path,
                          place=functools.partial(hosts.place, placement=placement))  # fmt: skip
        try:
            assert mesh.base_url.startswith(f"http://{net['front'].address}:")
            assert_equals_offline_vllm(mesh, oracle("llava"))
            # The embeddings crossed from the encoder's host to the worker's.
            assert mesh.metric("worker", "prism_nixl_bytes_read_total") > 0
        finally:
            mesh.stop()


def test_e_p_d_across_hosts_equals_offline_vllm_and_survives_a_partition(models, oracle, tmp_path):
    """Encoder, prefill and two decodes each on a host of their own. Then one decode's host
    is cut off while it streams: its requests move to the other decode and complete within
    the deadline; once the link is back, the decode serves again."""
    names = ["front", "encode", "prefill", "decode0", "decode1"]
    with hosts.Hosts(names) as net:
        placement = {"gateway": net["front"], "processor": net["front"],
                     "encoder-0": net["encode"], "prefill-0": net["prefill"],
                     "decode-0": net["decode0"], "decode-1": net["decode1"]}  # fmt: skip
        mesh = start_mesh("llava", "e/p/d", models["llava"], tmp_path, decode_workers=2,
                          place=functools.partial(hosts.place, placement=placement))  # fmt: skip
        try:
            assert_equals_offline_vllm(mesh, oracle("llava"))
            # The KV crossed from the prefill's host to the decodes'.
            source = {"source": "external_kv_transfer"}
            read = [mesh.metric(d, "vllm:prompt_tokens_by_source_total", **source)
                    for d in ("decode-0", "decode-1")]  # fmt: skip
            assert sum(read) > 0, read

            outcomes: list[str] = []

            def client(i: int) -> None:
                parts = [{"type": "image_url", "image_url": {"url": data_url(png(300 + i))}}]
                body = {"model": mesh.model, "messages": user(*parts, "Go on."),
                        "max_tokens": 200, "temperature": 0}  # fmt: skip
                outcomes.append(stream_outcome(mesh.base_url, body, timeout=90))

            threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            decode0 = mesh.address("decode-0")
            assert wait_for(
                lambda: mesh.metric("decode-0", "prism_engine_requests_in_flight") > 0, timeout=60
            )
            net.partition("decode0")
            for thread in threads:
                thread.join(timeout=120)
            assert outcomes == ["completed"] * 4, (outcomes, mesh.log_problems())
            net.heal("decode0")
            assert wait_for(lambda: check_health(decode0), timeout=30)
            # Back in routing: new requests reach it again.
            before = mesh.metric("decode-0", "vllm:request_success_total")

            def served_again() -> bool:
                client(99)
                return mesh.metric("decode-0", "vllm:request_success_total") > before

            assert wait_for(served_again, timeout=60, period=0.5), mesh.log_problems()
        finally:
            mesh.stop()
