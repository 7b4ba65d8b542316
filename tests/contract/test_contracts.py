"""Contract tests: each RPC of EngineService and InferenceService, over real gRPC against
the stages of a running mesh."""

from __future__ import annotations

import itertools
import os
import time

import grpc
import psutil
import pytest
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from support.calls import abort_while_running, greedy, inference, text_message
from support.cases import ADAPTERS, CASES
from support.waiting import wait_for
from transformers import AutoTokenizer

from prism.modes import MODES
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.channel import check_health, sync_channel
from prism.rpc.errors import PrismError
from prism.rpc.server import LOAD_SERVICE

ENGINE_STAGES = ("worker", "prefill", "decode")


def engine(mesh) -> engine_pb2_grpc.EngineServiceStub:
    """The aggregated worker (the prefill and decode roles have their own tests)."""
    if MODES[mesh.mode].disaggregated:
        pytest.skip("no aggregated worker in this mode")
    return engine_pb2_grpc.EngineServiceStub(sync_channel(mesh.worker))


def endless(request_id: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7],
        sampling=greedy(2000, ignore_eos=True),
    )  # fmt: skip


def test_generate_streams_token_ids(mesh):
    request = engine_pb2.GenerateRequest(
        request_id="contract-gen", prompt_token_ids=[5, 6, 7, 8], sampling=greedy(5)
    )
    replies = list(engine(mesh).Generate(request, timeout=60))
    # The first message says what the engine made of the prompt, the last how it ended;
    # the ones between carry tokens only.
    positions = [r.WhichOneof("position") for r in replies]
    assert positions == ["first", *[None] * (len(replies) - 2), "last"]
    assert replies[0].first.prompt_tokens == 4
    assert sum(len(r.token_ids) for r in replies) == 5
    assert replies[-1].last.reason == common_pb2.FINISH_REASON_LENGTH


def test_generate_rejects_a_request_without_prompt(mesh):
    with pytest.raises(grpc.RpcError) as info:
        list(engine(mesh).Generate(engine_pb2.GenerateRequest(request_id="x"), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert PrismError.from_rpc_error(info.value).param == "prompt_token_ids"


def test_generate_rejects_a_prompt_longer_than_the_context(mesh):
    request = engine_pb2.GenerateRequest(
        request_id="too-long", prompt_token_ids=[5] * 5000, sampling=greedy(4)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(engine(mesh).Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_engine_abort_ends_a_running_request(mesh):
    stub = engine(mesh)
    abort = engine_pb2.EngineServiceAbortRequest(request_id="contract-abort")
    last = abort_while_running(
        lambda: stub.Generate(endless("contract-abort"), timeout=120),
        lambda: stub.Abort(abort).aborted,
    )[-1]
    assert last.last.reason == common_pb2.FINISH_REASON_ABORT
    reply = stub.Abort(engine_pb2.EngineServiceAbortRequest(request_id="contract-abort"))
    assert not reply.aborted


def test_cancelled_generate_is_aborted_in_the_engine(mesh):
    stub = engine(mesh)
    call = stub.Generate(endless("contract-cancel"), timeout=120)
    next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    # The engine forgets the request once vLLM has aborted it.
    while stub.Abort(engine_pb2.EngineServiceAbortRequest(request_id="contract-cancel")).aborted:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    after = engine_pb2.GenerateRequest(
        request_id="after-cancel", prompt_token_ids=[5], sampling=greedy(2)
    )
    assert sum(len(r.token_ids) for r in stub.Generate(after, timeout=60)) == 2


def test_generate_batch_runs_many_calls_on_one_stream_as_generate_runs_each(mesh):
    stub = engine(mesh)
    prompts = {1: [5, 6, 7, 8], 2: [9, 10, 11], 3: []}
    starts = [
        engine_pb2.GenerateBatchRequest(
            call_id=call_id,
            start=engine_pb2.GenerateRequest(
                request_id=f"contract-batch-{call_id}", prompt_token_ids=ids, sampling=greedy(6)
            ),
            metadata={"x-request-id": f"contract-batch-{call_id}"},
        )
        for call_id, ids in prompts.items()
    ]
    # The request stream ends after the starts: the server ends its own once they are done.
    batches = list(stub.GenerateBatch(iter(starts), timeout=60))
    replies: dict[int, list[int]] = {1: [], 2: []}
    ends = {}
    for event in (e for batch in batches for e in batch.events):
        if event.WhichOneof("event") == "reply":
            replies[event.call_id] += event.reply.token_ids
        else:
            ends[event.call_id] = event.end.code
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert ends == {1: 0, 2: 0, 3: invalid}
    for call_id in (1, 2):
        alone = engine_pb2.GenerateRequest(
            request_id=f"contract-alone-{call_id}", prompt_token_ids=prompts[call_id],
            sampling=greedy(6),
        )  # fmt: skip
        tokens = [t for r in stub.Generate(alone, timeout=60) for t in r.token_ids]
        assert replies[call_id] == tokens and len(tokens) == 6


def test_engine_processes_run_nicer_than_the_request_path(mesh):
    """On the CPU backend the engine steps without pause while it has requests: below
    the priority of every stage, it cannot starve the gRPC and input processing that
    feed it. Niceness weighs only within a session (the kernel's autogroups), so the
    stages share the launcher's."""
    engines = [s for s in mesh.mesh.stages if s.name.split("-")[0] in ENGINE_STAGES]
    assert engines
    for stage in mesh.mesh.stages:
        assert os.getsid(stage.process.pid) == os.getsid(0), stage.name
    for stage in engines:
        worker = psutil.Process(stage.process.pid)
        children = worker.children(recursive=True)
        assert children, stage.name
        for child in children:
            assert child.nice() == worker.nice() + 10, (stage.name, child.name())


def test_the_model_runs_inside_the_engine_core(mesh):
    """On the CPU backend a second vLLM process for the model would spin beside the
    engine core, waiting for each step: each engine stage has one vLLM process. The core
    is forked from its worker, not spawned (which would leave multiprocessing's tracker
    process beside it, after importing vLLM again)."""
    for stage in mesh.mesh.stages:
        if stage.name.split("-")[0] in ENGINE_STAGES:
            children = psutil.Process(stage.process.pid).children(recursive=True)
            names = [c.name() for c in children]
            assert names == ["VLLM::EngineCore"], (stage.name, names)


def test_chat_streams_deltas_with_usage_so_far(mesh, oracle):
    expected = oracle(mesh.family)["text_only"]
    _, messages, max_tokens = CASES["text_only"]
    request = inference_pb2.ChatRequest(
        model=mesh.model,
        messages=[
            inference_pb2.ChatMessage(
                role=inference_pb2.ROLE_SYSTEM,
                content=[inference_pb2.ContentPart(text=messages[0]["content"])],
            ),
            text_message(messages[1]["content"]),
        ],
        sampling=greedy(max_tokens),
    )
    replies = list(inference(mesh).Chat(request, timeout=60))
    assert "".join(r.text for r in replies) == expected["text"]
    assert [t for r in replies for t in r.token_ids] == expected["token_ids"]
    assert replies[-1].usage.completion_tokens == len(expected["token_ids"])
    assert replies[-1].usage.prompt_tokens == expected["prompt_tokens"]
    assert replies[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    # Every message has the counts so far.
    sent = itertools.accumulate(len(r.token_ids) for r in replies)
    assert [r.usage.completion_tokens for r in replies] == list(sent)
    assert len({r.request_id for r in replies}) == 1


def test_stop_string_cuts_the_text(mesh, oracle):
    full = oracle(mesh.family)["completion"]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), "the oracle text is too short to pick a stop string"
    request = inference_pb2.CompleteRequest(
        model=mesh.model, text=CASES["completion"][1], sampling=greedy(16, stop=[stop])
    )
    replies = list(inference(mesh).Complete(request, timeout=60))
    text = "".join(r.text for r in replies)
    assert text == full[: full.index(stop)]
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_complete_accepts_token_ids(mesh, oracle):
    expected = oracle(mesh.family)["completion"]
    prompt = CASES["completion"][1]
    ids = AutoTokenizer.from_pretrained(mesh.model).encode(prompt)
    request = inference_pb2.CompleteRequest(
        model=mesh.model, token_ids=inference_pb2.TokenIds(ids=ids), sampling=greedy(16)
    )
    replies = list(inference(mesh).Complete(request, timeout=60))
    assert "".join(r.text for r in replies) == expected["text"]


def test_list_models(mesh):
    # The base model, then the LoRA adapters the shared meshes serve (support.cases.ADAPTERS).
    reply = inference(mesh).ListModels(inference_pb2.ListModelsRequest())
    assert [m.id for m in reply.models] == [mesh.model, *ADAPTERS]
    assert [m.parent for m in reply.models] == ["", *[mesh.model] * len(ADAPTERS)]
    assert reply.models[0].max_model_len > 0


def test_abort_by_request_id(mesh):
    stub = inference(mesh)
    request = inference_pb2.CompleteRequest(
        request_id="contract-public-abort", model=mesh.model, text="Once upon a time",
        sampling=greedy(2000, ignore_eos=True),
    )  # fmt: skip
    abort = inference_pb2.AbortRequest(request_id="contract-public-abort")
    replies = abort_while_running(
        lambda: stub.Complete(request, timeout=120), lambda: stub.Abort(abort).aborted
    )
    assert replies[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert replies[-1].usage.completion_tokens < 2000
    assert not stub.Abort(inference_pb2.AbortRequest(request_id="contract-public-abort")).aborted
    # Nothing is held for it: in P/D, not even the KV a prefill finished just before the
    # abort landed (its lease would keep it for 30 s).
    assert wait_for(
        lambda: (
            not any(mesh.metric(stage, "vllm:kv_cache_usage_perc") for stage in mesh.engine_stages)
        )
    ), {stage: mesh.metric(stage, "vllm:kv_cache_usage_perc") for stage in mesh.engine_stages}


def test_unknown_model_is_not_found(mesh):
    request = inference_pb2.ChatRequest(model="nope", messages=[text_message("hi")])
    with pytest.raises(grpc.RpcError) as info:
        list(inference(mesh).Chat(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert PrismError.from_rpc_error(info.value).reason_name == "MODEL_NOT_FOUND"


def test_health_and_reflection(mesh):
    stages = [(mesh.processor, "prism.v1.InferenceService")]
    stages += [(address, "prism.stage.v1.EngineService") for address in mesh.engines]
    for address, service in stages:
        assert check_health(address, service, timeout=10)
        services = ProtoReflectionDescriptorDatabase(sync_channel(address)).get_services()
        assert service in services and "grpc.health.v1.Health" in services
        # The stages a processor routes to report their load.
        assert (LOAD_SERVICE in services) == (service == "prism.stage.v1.EngineService")
