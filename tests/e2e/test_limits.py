"""Overload, deadlines and graceful shutdown on a mesh of real processes: the processor
takes at most 4 requests at once, the gateway gives each 1 s."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

import grpc
import httpx
import pytest
from support.content import user
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.ops.stage_process import StageProcess
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2
from prism.rpc.channel import check_health, sync_channel
from prism.rpc.errors import PrismError

BOUND, TIMEOUT_S = 4, 1.5


def long_grace(stages: list[StageProcess]) -> None:
    """A worker's drain grace that test_sigterm_drains_a_worker's 1000 tokens fit in,
    however busy the machine (the default 10 s did not always)."""
    for stage in stages:
        if stage.name.startswith("worker"):
            stage.argv += ["--shutdown-grace-s", "120"]


@pytest.fixture(scope="module")
def bounded(models, tmp_path_factory):
    mesh = start_mesh("llava", "epd", models["llava"], tmp_path_factory.mktemp("limits"),
                      place=long_grace, max_in_flight=BOUND,
                      request_timeout=TIMEOUT_S)  # fmt: skip
    # An engine's first requests pay one-time set-up that could overrun the deadline.
    for _ in range(3):
        httpx.post(f"{mesh.base_url}/chat/completions", json=chat(mesh, 4), timeout=60)
    yield mesh
    mesh.stop()


def chat(mesh, max_tokens: int, stream: bool = False) -> dict:
    return {"model": mesh.model, "messages": user("Go on."), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


def in_flight(mesh) -> float:
    return mesh.metrics("worker")["prism_engine_requests_in_flight"]


def test_past_the_bound_clients_get_429_with_retry_after_and_never_5xx(bounded):
    statuses: Counter[int] = Counter()
    retry_after: set[str] = set()
    lock = threading.Lock()
    clients = 24
    # One client made beforehand and a barrier: each thread making its own client (and SSL
    # context) staggered the requests so much that fewer than the bound overlapped.
    start = threading.Barrier(clients)
    url = f"{bounded.base_url}/chat/completions"

    def client(http: httpx.Client) -> None:
        start.wait(timeout=30)
        # Short enough to finish within the gateway's deadline, long enough to overlap.
        with http.stream("POST", url, json=chat(bounded, 24, stream=True)) as reply:
            reply.read()
            with lock:
                statuses[reply.status_code] += 1
                if reply.status_code == 429:
                    retry_after.add(reply.headers.get("Retry-After", ""))

    limits = httpx.Limits(max_connections=clients)
    with httpx.Client(timeout=60, limits=limits) as http:
        threads = [threading.Thread(target=client, args=(http,)) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert sum(statuses.values()) == clients
    assert statuses[200] >= BOUND and statuses[429] >= 1, statuses
    assert set(statuses) <= {200, 429}, (statuses, bounded.log_tail())
    assert retry_after == {"1"}
    assert wait_for(lambda: in_flight(bounded) == 0)


def test_a_request_past_its_deadline_is_504_and_aborted_everywhere(bounded):
    started = time.monotonic()
    reply = httpx.post(f"{bounded.base_url}/chat/completions", json=chat(bounded, 2000),
                       timeout=60)  # fmt: skip
    assert reply.status_code == 504, reply.text
    assert reply.json()["error"]["code"] == "deadline_exceeded"
    assert time.monotonic() - started < TIMEOUT_S + 5
    # The engine stopped generating for it.
    assert wait_for(lambda: in_flight(bounded) == 0, timeout=10)
    assert httpx.post(f"{bounded.base_url}/chat/completions", json=chat(bounded, 4),
                      timeout=60).status_code == 200  # fmt: skip


def test_sigterm_drains_a_worker(bounded):
    """Last: it takes the worker down. In flight finishes; nothing new is taken: the
    worker itself refuses it while its own request runs (long enough to outlast the
    late one), rather than gRPC's shutdown cancelling it."""
    stage = bounded.mesh.stage("worker")
    stub = engine_pb2_grpc.EngineServiceStub(sync_channel(stage.address))
    request = engine_pb2.GenerateRequest(
        request_id="drain-me", prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True),
    )  # fmt: skip
    call = stub.Generate(request, timeout=120)
    first = next(call)
    assert first.token_ids
    os.kill(stage.process.pid, signal.SIGTERM)
    assert wait_for(lambda: not check_health(stage.address), timeout=5)
    late = engine_pb2.GenerateRequest(request_id="too-late", prompt_token_ids=[5],
                                      sampling=request.sampling)  # fmt: skip
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(late, timeout=10))
    refused = PrismError.from_rpc_error(info.value)
    assert (refused.code, refused.message) == (
        grpc.StatusCode.UNAVAILABLE,
        "the server is shutting down",
    )
    replies = list(call)
    assert replies[-1].last.reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in [first, *replies]) == 1000
    assert stage.process.wait(timeout=30) == 0
