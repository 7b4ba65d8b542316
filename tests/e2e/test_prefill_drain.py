"""A prefill drained (scaled down by the planner, or sent SIGTERM) after it handed a
prompt's KV cache to a decode lives on until that decode has read it: the request ends
well, then the prefill exits. On vLLM, where the prefill asks its engine's KV connector
what a decode has yet to read, and on simulated engines, whose decode reads the KV slowly
enough for the drain to come in between its start and its end."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.calls import greedy
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2
from prism.rpc.channel import check_health, sync_channel

PROMPT = list(range(5, 105))
# Decode's read of the prompt's 100 tokens of KV takes 2 s.
KV_TOKENS_PER_S = 50


# Each engine's settings, and how long the drained prefill is watched before decode reads:
# on vLLM longer than a drained stage with nothing held takes to exit (its engine's
# shutdown is bounded by 5 s); a simulated decode reads over the prefill's gRPC server,
# which the drain soon stops taking new calls on.
ENGINES = {
    "vllm": ({}, 8.0),
    "sim": ({"engine": "sim", "sim_kv_tokens_per_s": KV_TOKENS_PER_S}, 1.0),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_drained_prefill_lives_until_a_decode_has_read_its_kv(models, tmp_path, engine):
    settings, watched_s = ENGINES[engine]
    mesh = start_mesh("llava", "ep/d", models["llava"], tmp_path, **settings)
    try:
        prefill, decode = mesh.mesh.stage("prefill"), mesh.mesh.stage("decode")
        request = engine_pb2.GenerateRequest(
            request_id="drained", prompt_token_ids=PROMPT, sampling=greedy(8)
        )
        prefilled = list(
            engine_pb2_grpc.EngineServiceStub(sync_channel(prefill.address)).Generate(
                request, timeout=30
            )
        )
        handed_off = prefilled[-1].last.kv_transfer_params
        # vLLM adds a suffix of its own to the id it was given.
        assert handed_off.remote_request_id.startswith("drained")
        os.kill(prefill.process.pid, signal.SIGTERM)
        # Draining: it takes no new requests, though it lives on for what it holds.
        assert wait_for(lambda: not check_health(prefill.address), timeout=10)
        time.sleep(watched_s)
        assert prefill.process.poll() is None
        read = engine_pb2.GenerateRequest(
            request_id="drained", prompt_token_ids=PROMPT, sampling=greedy(8),
            kv_transfer_params=handed_off,
        )  # fmt: skip
        replies = list(
            engine_pb2_grpc.EngineServiceStub(sync_channel(decode.address)).Generate(
                read, timeout=30
            )
        )
        assert replies[-1].last.reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(reply.token_ids) for reply in replies) == 8
        # Once read, nothing holds it.
        assert prefill.process.wait(timeout=10) == 0
    finally:
        mesh.stop()
