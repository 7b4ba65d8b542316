"""End to end through real processes: the Responses API (POST /v1/responses) in every mode,
answered as `vllm serve` answers it on the same tiny model: a follow-up by
previous_response_id, the official SDK's `responses` client with an image, whole and
streamed, and the store's GET and DELETE; and the same over gRPC
(prism.v1.ResponsesService), whose store is REST's. (The cases each mesh answers alike, whole and
streamed, are test_openai_parity.py's, `responses_*` in tests/support/parity.py.)"""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest
from support import parity
from support.cases import openai_client

from prism.proto.v1 import responses_pb2, responses_pb2_grpc
from prism.rpc.errors import PrismError


def test_the_responses_cases_are_not_trivial(mesh, served):
    answers = {name: parity.comparable(served(mesh.family)[name])
               for name in parity.responses_cases(None)}  # fmt: skip
    (call,) = [i for i in answers["responses_tool_call"]["output"] if i["type"] == "function_call"]
    assert call["name"] == "get_weather" and call["call_id_ok"], call
    (message,) = answers["responses_schema"]["output"]
    jsonschema.validate(json.loads(message["content"][0]["text"]), parity.SCHEMA)
    streamed = answers["responses_image_stream"]["events"]
    assert streamed[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert streamed[-1] == "response.completed"
    assert len(answers["responses_logprobs"]["output"][0]["content"][0]["logprobs"]) == 4


def test_a_follow_up_by_previous_response_id_sees_the_first_turn(mesh, served):
    cases = parity.responses_cases(mesh.model)
    first = parity.ask(mesh.base_url, mesh.model, cases["responses_text"])
    follow_up = parity.following(cases["followup_responses_text"], {"responses_text": first})
    got = parity.comparable(parity.ask(mesh.base_url, mesh.model, follow_up))
    expected = parity.comparable(served(mesh.family)["followup_responses_text"])
    assert got == expected
    # The first turn is in the prompt: more tokens than the follow-up's own.
    alone = parity.comparable(served(mesh.family)["responses_text"])
    assert got["usage"][0] > alone["usage"][0]


def test_the_openai_sdk_sends_an_image_whole_and_streamed(mesh, served):
    client = openai_client(mesh)
    _, body = parity.responses_cases(mesh.model)["responses_image"]
    whole = parity.comparable(served(mesh.family)["responses_image"])
    answer = client.responses.create(model=mesh.model, **body)
    assert answer.output_text == whole["output"][0]["content"][0]["text"]
    assert (answer.usage.input_tokens, answer.usage.output_tokens) == whole["usage"][:2]
    assert answer.status == whole["response_status"]
    streamed = parity.comparable(served(mesh.family)["responses_image_stream"])
    with client.responses.stream(model=mesh.model, **body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert parity.event_kinds(kinds) == streamed["events"]
    assert final.output_text == streamed["output"][0]["content"][0]["text"]


def test_a_stored_response_is_got_deleted_and_then_unknown(mesh):
    cases = parity.responses_cases(mesh.model)
    _, body = cases["responses_text"]
    url = f"{mesh.base_url}/responses"
    first = httpx.post(url, json={**body, "model": mesh.model}, timeout=120).json()
    assert httpx.get(f"{url}/{first['id']}", timeout=30).json() == first
    assert httpx.delete(f"{url}/{first['id']}", timeout=30).json()["deleted"] is True
    for answer in (
        httpx.get(f"{url}/{first['id']}", timeout=30),
        httpx.post(url, json={**body, "model": mesh.model, "previous_response_id": first["id"]},
                   timeout=30),
    ):  # fmt: skip
        assert answer.status_code == 404
        assert first["id"] in answer.json()["error"]["message"]


def test_bad_items_and_fields_are_400s_naming_them(mesh):
    url = f"{mesh.base_url}/responses"
    for body, param in (
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                   "image_url": "data:image/png;base64,AAAA"}]}]},
         "input[0].content[0].image_url"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ):  # fmt: skip
        answer = httpx.post(url, json={"model": mesh.model, **body}, timeout=60)
        assert 400 <= answer.status_code < 500, answer.text
        assert answer.json()["error"]["param"] == param, answer.text


# Over gRPC (prism.v1.ResponsesService, on the front's gRPC port): the same answers.
GRPC_CASES = ("responses_image", "responses_image_stream", "responses_tool_call_stream",
              "responses_tool_output", "responses_logprobs")  # fmt: skip


def respond(mesh, body: dict) -> dict:
    """`body` asked over gRPC, answered as parity.ask answers over REST."""
    request = responses_pb2.RespondRequest(request=json.dumps({**body, "model": mesh.model}))
    with grpc.insecure_channel(mesh.processor) as channel:
        replies = list(responses_stub(channel).Respond(request, timeout=120))
    answers = [json.loads(getattr(r, r.WhichOneof("answer"))) for r in replies]
    if body.get("stream"):
        return {"status": 200, "chunks": answers}
    (response,) = answers
    return {"status": 200, "body": response}


def responses_stub(channel: grpc.Channel) -> responses_pb2_grpc.ResponsesServiceStub:
    return responses_pb2_grpc.ResponsesServiceStub(channel)


def test_grpc_answers_as_vllm_serve_does(mesh, served):
    cases = parity.responses_cases(mesh.model)
    for name in GRPC_CASES:
        expected = parity.comparable(served(mesh.family)[name])
        assert parity.comparable(respond(mesh, cases[name][1])) == expected, name


def test_grpc_and_rest_share_the_store(mesh, served):
    cases = parity.responses_cases(mesh.model)
    first = respond(mesh, cases["responses_text"][1])
    follow_up = parity.following(cases["followup_responses_text"], {"responses_text": first})
    got = parity.comparable(parity.ask(mesh.base_url, mesh.model, follow_up))
    assert got == parity.comparable(served(mesh.family)["followup_responses_text"])
    response_id = first["body"]["id"]
    with grpc.insecure_channel(mesh.processor) as channel:
        stub = responses_stub(channel)
        stored = stub.GetResponse(responses_pb2.GetResponseRequest(response_id=response_id))
        assert json.loads(stored.response) == first["body"]
        stub.DeleteResponse(responses_pb2.DeleteResponseRequest(response_id=response_id))
        with pytest.raises(grpc.RpcError) as gone:
            stub.GetResponse(responses_pb2.GetResponseRequest(response_id=response_id))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert response_id in gone.value.details()
    assert httpx.get(f"{mesh.base_url}/responses/{response_id}", timeout=30).status_code == 404


def test_grpc_bad_items_and_fields_name_them(mesh):
    for body, param in (
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            respond(mesh, body)
        error = PrismError.from_rpc_error(refused.value)
        assert error.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        assert error.param == param, error
