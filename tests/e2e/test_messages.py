"""End to end through real processes: the official anthropic SDK against the gateway's
Messages API, in every mode. With greedy sampling every answer equals, token for token,
what one plain offline vLLM engine gives to the same chat (tests/support/oracle.py); the
same over gRPC (prism.v1.MessagesService). (The cases each mesh answers as `vllm serve`
does, whole and streamed, are test_openai_parity.py's, `messages_*` in
tests/support/parity.py.)"""

from __future__ import annotations

import json

import anthropic
import grpc
import pytest
from support import parity
from support.cases import CASES

from prism.proto.v1 import messages_pb2, messages_pb2_grpc
from prism.rpc.errors import PrismError

# The chat cases with an image and with a system prompt.
MESSAGES_CASES = ("one_image", "text_only")


def client(mesh) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=mesh.base_url.removesuffix("/v1"), api_key="unused", max_retries=0
    )


def _block(part: dict) -> dict:
    """An OpenAI content part as Anthropic's block."""
    if part["type"] == "text":
        return part
    header, data = part["image_url"]["url"].split(",", 1)
    media_type = header.removeprefix("data:").removesuffix(";base64")
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


def request(mesh, case: str, **fields) -> dict:
    """A chat case as a Messages request: its system message as `system`, greedy."""
    _, chat, max_tokens = CASES[case]
    body = {"model": mesh.model, "max_tokens": max_tokens, "messages": [],
            "extra_body": {"temperature": 0}, **fields}  # fmt: skip
    for message in chat:
        content = message["content"]
        if message["role"] == "system":
            body["system"] = content
            continue
        if isinstance(content, list):
            content = [_block(part) for part in content]
        body["messages"].append({"role": message["role"], "content": content})
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("case", MESSAGES_CASES)
def test_messages_match_offline_vllm(mesh, oracle, case, stream):
    expected = oracle(mesh.family)[case]
    sdk = client(mesh)
    if stream:
        with sdk.messages.stream(**request(mesh, case)) as events:
            message = events.get_final_message()
    else:
        message = sdk.messages.create(**request(mesh, case))
    assert "".join(block.text for block in message.content) == expected["text"]
    assert message.usage.output_tokens == len(expected["token_ids"])
    cached = message.usage.cache_read_input_tokens or 0
    assert message.usage.input_tokens + cached == expected["prompt_tokens"]
    reasons = {"length": "max_tokens", "stop": "end_turn"}
    assert message.stop_reason == reasons[expected["finish_reason"]]


def test_a_stop_sequence_ends_the_answer_and_is_named(mesh, oracle):
    text = oracle(mesh.family)["text_only"]["text"]
    # A piece of the answer after its start: the answer stops before it.
    stop = text[len(text) // 2 :][:3]
    message = client(mesh).messages.create(**request(mesh, "text_only", stop_sequences=[stop]))
    answer = "".join(block.text for block in message.content)
    assert text.startswith(answer) and stop not in answer
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


def test_a_bad_request_is_anthropics_400(mesh):
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(mesh).messages.create(model=mesh.model, max_tokens=0,
                                     messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_the_messages_cases_are_not_trivial(mesh, served):
    """Guards the Messages parity cases (compared with `vllm serve`'s answers in
    test_openai_parity.py): they exercise what they name."""
    answers = {name: parity.comparable(served(mesh.family)[name])
               for name in parity.messages_cases() if not name.startswith("bad_")}  # fmt: skip
    assert answers["messages_system_stop"]["stop"][0] == "stop_sequence"
    assert answers["messages_image"]["content"][0]["text"]
    streamed = answers["messages_image_stream"]["events"]
    assert streamed[:2] == ["message_start", "content_block_start"]
    assert streamed[-2:] == ["message_delta", "message_stop"]
    assert answers["messages_tool_result"]["usage"][0] > answers["messages_text"]["usage"][0]
    # The tool named is called (a random-weight model's call may be cut by max_tokens,
    # and whole, vLLM's server then answers its text).
    streamed = answers["messages_tool_named_stream"]["content"]
    assert [(b["type"], b["name"]) for b in streamed] == [("tool_use", "get_weather")]
    (whole,) = answers["messages_tool_named"]["content"]
    assert whole.get("name") == "get_weather" or "get_weather" in whole.get("text", "")


def test_what_vllm_refuses_is_refused(mesh, served):
    assert served(mesh.family)["bad_messages_no_max_tokens"]["status"] == 400
    case = parity.messages_cases()["bad_messages_no_max_tokens"]
    assert parity.ask(mesh.base_url, mesh.model, case)["status"] == 400


# Over gRPC (prism.v1.MessagesService, on the front's gRPC port): the same answers.
GRPC_CASES = ("messages_image", "messages_image_stream", "messages_system_stop")


def create(mesh, body: dict) -> dict:
    """`body` asked over gRPC, answered as parity.ask answers over REST."""
    request = messages_pb2.CreateMessageRequest(request=json.dumps({**body, "model": mesh.model}))
    with grpc.insecure_channel(mesh.processor) as channel:
        stub = messages_pb2_grpc.MessagesServiceStub(channel)
        replies = list(stub.CreateMessage(request, timeout=120))
    answers = [json.loads(getattr(r, r.WhichOneof("answer"))) for r in replies]
    if body.get("stream"):
        return {"status": 200, "chunks": answers}
    (message,) = answers
    return {"status": 200, "body": message}


def test_grpc_answers_as_vllm_serve_does(mesh, served):
    cases = parity.messages_cases()
    for name in GRPC_CASES:
        expected = parity.comparable(served(mesh.family)[name])
        assert parity.comparable(create(mesh, cases[name][1])) == expected, name
    with pytest.raises(grpc.RpcError) as refused:
        create(mesh, parity.messages_cases()["bad_messages_no_max_tokens"][1])
    error = PrismError.from_rpc_error(refused.value)
    assert (error.code, error.param) == (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens")
