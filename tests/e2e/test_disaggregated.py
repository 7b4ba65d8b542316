"""The prefill and decode roles (E/P/D and EP/D meshes): the KV cache really crosses from
prefill to decode, failures end with a clear status, and no KV blocks are left behind."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
from collections.abc import Iterator

import grpc
import pytest
from support.calls import abort_while_running, greedy, inference, text_message
from support.waiting import wait_for

from prism.modes import MODES
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import PrismError
from prism.runtime.ports import free_port

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture
def pd(mesh):
    if not MODES[mesh.mode].disaggregated:
        pytest.skip("no prefill/decode workers in this mode")
    return mesh


def stub(mesh, stage: str) -> engine_pb2_grpc.EngineServiceStub:
    return engine_pb2_grpc.EngineServiceStub(mesh.channel(stage))


def kv_idle(mesh, stage: str) -> bool:
    return mesh.metric(stage, "vllm:kv_cache_usage_perc") == 0


def prefill(mesh, request_id: str, prompt=PROMPT, **sampling) -> list:
    """A prefill's replies: its first message and its last."""
    request = engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=greedy(8, **sampling)
    )
    return list(stub(mesh, "prefill").Generate(request, timeout=60))


def decode_request(request_id: str, prefilled: list, prompt=PROMPT):
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=greedy(8),
        kv_transfer_params=prefilled[-1].last.kv_transfer_params,
    )  # fmt: skip


def test_prefill_returns_the_first_token_and_typed_kv_params(pd):
    prefilled = prefill(pd, "pd-prefill")
    try:
        first, last = prefilled
        assert len(first.token_ids) == 1 and not last.token_ids
        assert last.last.reason == common_pb2.FINISH_REASON_LENGTH
        assert first.first.prompt_tokens == len(PROMPT)
        kv = last.last.kv_transfer_params
        assert kv.do_remote_prefill and not kv.do_remote_decode
        assert kv.remote_engine_id and kv.remote_request_id and kv.remote_host == "127.0.0.1"
        assert kv.remote_port > 0 and kv.transfer_mode == "pull"
        assert kv.remote_num_tokens == len(PROMPT) and len(kv.remote_block_ids[0].ids) >= 1
        assert (kv.tp_size, kv.dcp_size, kv.pp_size) == (1, 1, 1) and not kv.extra
        assert wait_for(lambda: not kv_idle(pd, "prefill")), "prefill holds the KV for decode"
    finally:
        stub(pd, "prefill").Abort(engine_pb2.EngineServiceAbortRequest(request_id="pd-prefill"))


def test_decode_reads_the_prompt_kv_instead_of_recomputing_it(pd):
    source = "vllm:prompt_tokens_by_source_total"
    before = {
        s: pd.metric("decode", source, source=s) for s in ("external_kv_transfer", "local_compute")
    }
    prefilled = prefill(pd, "pd-transfer")
    replies = list(stub(pd, "decode").Generate(decode_request("pd-transfer", prefilled)))
    tokens = [t for reply in replies for t in reply.token_ids]
    assert tokens[0] == prefilled[0].token_ids[0] and len(tokens) == 8
    assert replies[-1].last.reason == common_pb2.FINISH_REASON_LENGTH

    def grown() -> dict[str, float]:
        return {s: pd.metric("decode", source, source=s) - before[s] for s in before}

    assert wait_for(lambda: grown()["external_kv_transfer"] > 0)
    # The whole prompt came over NIXL; at most its last token is recomputed locally.
    assert grown()["external_kv_transfer"] >= len(PROMPT) - 1
    assert grown()["local_compute"] <= 1
    # Reading the KV released it on the prefill side.
    assert wait_for(lambda: kv_idle(pd, "prefill"))


def test_decode_needs_kv_params(pd):
    request = engine_pb2.GenerateRequest(
        request_id="pd-no-kv", prompt_token_ids=PROMPT, sampling=greedy(4)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(stub(pd, "decode").Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert PrismError.from_rpc_error(info.value).param == "kv_transfer_params"


def test_decode_fails_cleanly_when_the_prefill_kv_is_unreachable(pd):
    prefilled = prefill(pd, "pd-lost")
    stub(pd, "prefill").Abort(engine_pb2.EngineServiceAbortRequest(request_id="pd-lost"))
    lost = decode_request("pd-lost", prefilled)
    # Nobody listens there: the handshake with the prefill engine cannot succeed.
    lost.kv_transfer_params.remote_engine_id = "gone"
    lost.kv_transfer_params.remote_port = free_port()
    with pytest.raises(grpc.RpcError) as info:
        list(stub(pd, "decode").Generate(lost, timeout=60))
    error = PrismError.from_rpc_error(info.value)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason_name == "KV_TRANSFER_FAILED" and "gone" in error.message
    # Decode keeps serving, and frees what it had allocated for the failed request.
    again = prefill(pd, "pd-after-lost")
    replies = list(stub(pd, "decode").Generate(decode_request("pd-after-lost", again)))
    assert sum(len(reply.token_ids) for reply in replies) == 8
    assert wait_for(lambda: kv_idle(pd, "decode") and kv_idle(pd, "prefill"))


def test_prefill_abort_frees_kv_held_for_decode(pd):
    prefill(pd, "pd-held")
    assert wait_for(lambda: not kv_idle(pd, "prefill")), pd.log_problems()
    aborted = stub(pd, "prefill").Abort(engine_pb2.EngineServiceAbortRequest(request_id="pd-held"))
    assert aborted.aborted
    # Well before the connector's 30 s lease would have freed them.
    assert wait_for(lambda: kv_idle(pd, "prefill"), timeout=10)


def test_aborted_request_leaves_no_kv_blocks(pd):
    stub_ = inference(pd)
    request = inference_pb2.ChatRequest(
        request_id="pd-public-abort", messages=[text_message("Tell me everything.")],
        sampling=greedy(2000, ignore_eos=True),
    )  # fmt: skip

    def start() -> Iterator[inference_pb2.ChatResponse]:
        stream = stub_.Chat(request, timeout=120)
        assert next(stream).token_ids, "the first token comes from prefill, before decode"
        return stream

    abort = inference_pb2.AbortRequest(request_id="pd-public-abort")
    replies = abort_while_running(start, lambda: stub_.Abort(abort).aborted)
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert wait_for(lambda: kv_idle(pd, "prefill") and kv_idle(pd, "decode"))


def test_client_disconnect_leaves_no_kv_blocks(pd):
    request = inference_pb2.ChatRequest(
        messages=[text_message("Tell me a long story.")], sampling=greedy(2000, ignore_eos=True)
    )
    stream = inference(pd).Chat(request, timeout=120)
    next(stream)
    stream.cancel()
    assert wait_for(lambda: kv_idle(pd, "prefill") and kv_idle(pd, "decode"))


def test_a_rest_client_gone_before_its_whole_answer_ends_the_generation(pd):
    answered = pd.metric("front", "prism_requests_total", status="499")
    chat = {"model": pd.model, "messages": [{"role": "user", "content": "A story."}],
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0}  # fmt: skip
    body = json.dumps(chat).encode()
    url = urllib.parse.urlsplit(pd.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as client:
        client.sendall(
            f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        assert wait_for(lambda: pd.metric("front", "prism_requests_in_flight") >= 1)
    # The client left with 2000 tokens to go: the front ends the generation on every stage.
    assert wait_for(lambda: pd.metric("front", "prism_requests_total", status="499") > answered)
    assert wait_for(lambda: kv_idle(pd, "prefill") and kv_idle(pd, "decode"))


def test_prefills_cut_short_at_any_moment_leave_no_kv_blocks(pd):
    """Prefills cancelled and then aborted, as the processor ends a request that gave up,
    from before the engine starts the prompt to after the worker sent its KV parameters:
    some land in the moment the engine has finished the prompt, holding its KV for a
    decode, while the worker has not read that output yet. Every hold is freed at once,
    not when its lease ends."""
    started = time.monotonic()
    prefill(pd, "pd-timed")
    took = time.monotonic() - started
    stub(pd, "prefill").Abort(engine_pb2.EngineServiceAbortRequest(request_id="pd-timed"))
    assert wait_for(lambda: kv_idle(pd, "prefill")), pd.log_problems()
    for index in range(40):
        request_id = f"pd-cut-{index}"
        request = engine_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=PROMPT, sampling=greedy(8)
        )
        call = stub(pd, "prefill").Generate(request, timeout=60)
        time.sleep(took * index / 40)
        call.cancel()
        stub(pd, "prefill").Abort(engine_pb2.EngineServiceAbortRequest(request_id=request_id))
    # Well within the connector's 30 s lease.
    assert wait_for(lambda: kv_idle(pd, "prefill"), timeout=10), pd.log_problems()
