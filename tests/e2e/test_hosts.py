"""Meshes whose stages sit on simulated hosts (tests/support/hosts.py): embeddings and KV cross a
real network stack (UCX over TCP between network namespaces), and the processor reaches
every stage at its host's address. Greedy output still equals offline vLLM's with latency
and loss on the links (tests/support/netem.py), and a host cut off mid-request loses no request."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from support import hosts
from support.cases import assert_equals_offline_vllm, run_oracle
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh, stream_outcome, unavailable
from support.waiting import wait_for

from prism.rpc.channel import check_health
from prism.runtime import processes


# Module-scoped: before the module's meshes, which need the hosts.
@pytest.fixture(autouse=True, scope="module")
def simulated_hosts_available() -> None:
    if reason := hosts.available():
        unavailable(reason)


ECHO = """
import socket
server = socket.create_server(("0.0.0.0", 9000))
while True:
    connection, _ = server.accept()
    while data := connection.recv(65536):
        connection.sendall(data)
"""


def test_an_impaired_link_delays_and_loses_what_crosses_it():
    """The harness itself: a round trip to an impaired host takes at least twice its delay,
    every byte still arrives over TCP at 1 % loss, and at 100 % loss nothing does."""
    with hosts.Hosts(["far"], impairable=("far",)) as net:
        far = net["far"].address
        echo = subprocess.Popen(net["far"].command([sys.executable, "-c", ECHO]))
        try:

            def listening() -> bool:
                try:
                    socket.create_connection((far, 9000), timeout=1).close()
                except OSError:
                    return False
                return True

            assert wait_for(listening, timeout=10)

            def round_trip(size: int, timeout: float = 10) -> float:
                with socket.create_connection((far, 9000), timeout=timeout) as connection:
                    start = time.monotonic()
                    connection.sendall(b"x" * size)
                    received = 0
                    while received < size:
                        received += len(connection.recv(65536))
                    return time.monotonic() - start

            net.impair("far", delay_s=0.05, loss=0.01)
            assert round_trip(1 << 20) >= 0.1
            net.impair("far", loss=1.0)
            with pytest.raises(OSError):
                round_trip(1, timeout=1)
        finally:
            echo.kill()
            processes.reap(echo)


def test_e_pd_across_hosts_equals_offline_vllm_and_survives_losing_an_encoder_mid_request(
    models, oracle, tmp_path
):
    """Two encoders on hosts of their own. Then the host of the encoder that encoded a
    request's image is cut off between its Encode answer and the worker's NIXL read: the
    read fails, the image is encoded again on the other encoder and the request completes;
    once healed, the lease frees the slice nobody read and the encoder serves again."""
    with hosts.Hosts(["front", "encode0", "encode1", "work"]) as net:
        placement = {"front": net["front"],
                     "encoder-0": net["encode0"], "encoder-1": net["encode1"],
                     "worker-0": net["work"]}  # fmt: skip
        mesh = start_mesh("llava", "e/pd", models["llava"], tmp_path, encoders=2,
                          place=functools.partial(hosts.place, placement=placement))  # fmt: skip
        try:
            assert mesh.base_url.startswith(f"http://{net['front'].address}:")
            assert_equals_offline_vllm(mesh, oracle("llava"))
            # The embeddings crossed from the encoders' hosts to the worker's.
            assert mesh.metric("worker-0", "prism_nixl_bytes_read_total") > 0

            def published() -> list[float]:
                return [mesh.metric(e, "prism_nixl_published_total")
                        for e in ("encoder-0", "encoder-1")]  # fmt: skip

            before = published()
            outcome: list[str] = []
            body = {"model": mesh.model, "max_tokens": 16, "temperature": 0,
                    "messages": user(image_part(data_url(png(77))), "What is it?")}  # fmt: skip
            # The worker, stopped, holds the request in its socket until the holder is cut.
            worker = mesh.mesh.stage("worker-0").process.pid
            os.killpg(worker, signal.SIGSTOP)
            try:
                client = threading.Thread(
                    target=lambda: outcome.append(stream_outcome(mesh.base_url, body))
                )
                client.start()
                assert wait_for(lambda: published() != before, timeout=30)
                holder = 0 if published()[0] > before[0] else 1
                # The Encode answer is on its way to the processor, and the request to
                # the worker: both cross the bridge in well under this.
                time.sleep(1.0)
                net.partition(f"encode{holder}")
            finally:
                os.killpg(worker, signal.SIGCONT)
            client.join(timeout=90)
            assert outcome == ["completed"], (outcome, mesh.log_problems())
            other = f"encoder-{1 - holder}"
            assert mesh.metric(other, "prism_nixl_published_total") > before[1 - holder]

            net.heal(f"encode{holder}")
            cut = f"encoder-{holder}"
            assert wait_for(lambda: mesh.metric(cut, "prism_nixl_reclaimed_total") >= 1,
                            timeout=60)  # fmt: skip
            assert mesh.metric(cut, "prism_nixl_pool_bytes_in_use") == 0
            # Back in routing, and its embeddings read again.
            served = mesh.metric(cut, "prism_nixl_released_total")

            def serves_again() -> bool:
                assert stream_outcome(mesh.base_url, body) == "completed"
                return mesh.metric(cut, "prism_nixl_released_total") > served

            assert wait_for(serves_again, timeout=60, period=0.5), mesh.log_problems()
        finally:
            mesh.stop()


def partition_chat(i: int) -> list[dict]:
    return user(image_part(data_url(png(300 + i))), "Go on.")


def test_e_p_d_across_hosts_equals_offline_vllm_under_latency_and_loss_and_survives_a_partition(
    models, oracle, tmp_path
):
    """Encoder, prefill and two decodes each on a host of their own. The output stays
    offline vLLM's with 50 ms of latency and 1 % loss each way between the processor's host
    and the rest. Then one decode's host is cut off while it streams: its requests move to
    the other decode and complete within the deadline, each with offline vLLM's text; once
    the link is back, the decode serves again."""
    requests = (0, 1, 2, 3, 99)
    answers = run_oracle(models["llava"], tmp_path, {
        str(i): ("chat", partition_chat(i), 200, {"ignore_eos": True}) for i in requests
    })  # fmt: skip
    expected = {i: answers[str(i)]["text"] for i in requests}
    names = ["front", "encode", "prefill", "decode0", "decode1"]
    with hosts.Hosts(names, impairable=("front",)) as net:
        placement = {"front": net["front"],
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
                body = {"model": mesh.model, "messages": partition_chat(i), "max_tokens": 200,
                        "temperature": 0}  # fmt: skip
                outcomes.append(stream_outcome(mesh.base_url, body, 90, expected[i]))

            def clients() -> list[threading.Thread]:
                outcomes.clear()
                threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
                for thread in threads:
                    thread.start()
                return threads

            def all_completed(threads: list[threading.Thread]) -> None:
                for thread in threads:
                    thread.join(timeout=120)
                assert outcomes == ["completed"] * 4, (outcomes, mesh.log_problems())

            net.impair("front", delay_s=0.05, loss=0.01)
            assert_equals_offline_vllm(mesh, oracle("llava"))
            all_completed(clients())
            net.impair("front")

            threads = clients()
            decode0 = mesh.address("decode-0")
            assert wait_for(
                lambda: mesh.metric("decode-0", "prism_engine_requests_in_flight") > 0, timeout=60
            )
            net.partition("decode0")
            all_completed(threads)
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
