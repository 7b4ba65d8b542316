"""Anthropic's Messages API in the gateway alone, called by the official anthropic SDK
before a processor that answers from a script: the chat request each body becomes, the
message and the stream's events written from the replies, and errors in Anthropic's
shape; and the same over gRPC (called in this process)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import grpc
import pytest
from fastapi.testclient import TestClient
from support.scripted import Scripted, rpc

from prism.gateway.anthropic.rpc import messages_service
from prism.gateway.app import create_app
from prism.proto.v1 import common_pb2, inference_pb2, messages_pb2
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError

USAGE = common_pb2.Usage(prompt_tokens=9, completion_tokens=3, total_tokens=12, cached_tokens=4)
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
PNG = "iVBORw0KGgo="


def reply(text: str = "", finish: int = 0, **fields) -> inference_pb2.ChatResponse:
    return inference_pb2.ChatResponse(text=text, finish_reason=finish, model="m", usage=USAGE,
                                      **fields)  # fmt: skip


def sdk(processor: Scripted, api_key: str = "") -> tuple[anthropic.Anthropic, TestClient]:
    app = create_app(Router(StaticRegistry({})), processor=processor, api_key=api_key)
    http = TestClient(app)
    return anthropic.Anthropic(api_key=api_key or "none", base_url=str(http.base_url),
                               http_client=http, max_retries=0), http  # fmt: skip


def test_an_image_message_becomes_a_chat_and_its_answer_a_message():
    processor = Scripted([reply("Hel"), reply("lo", STOP)])
    client, http = sdk(processor)
    with http:
        message = client.messages.create(
            model="m", max_tokens=5, system="Be brief.", stop_sequences=["END"],
            # Sampling fields the SDK no longer names, which vLLM's server takes.
            extra_body={"temperature": 0.5, "top_k": 3},
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": PNG}},
                {"type": "text", "text": "What is it?"}]}],
        )  # fmt: skip
    (request,) = processor.requests
    system, user = request.messages
    assert (system.role, system.content[0].text) == (inference_pb2.ROLE_SYSTEM, "Be brief.")
    assert user.content[0].image.url == f"data:image/png;base64,{PNG}"
    assert user.content[1].text == "What is it?"
    sampling = request.sampling
    assert (sampling.max_tokens, list(sampling.stop), sampling.top_k) == (5, ["END"], 3)
    assert sampling.temperature == 0.5
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert [block.text for block in message.content] == ["Hello"]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 3)
    assert message.usage.cache_read_input_tokens == 4


@pytest.mark.parametrize(
    ("last", "reason", "sequence"),
    [(reply("!", STOP, stop_sequence="END"), "stop_sequence", "END"),
     (reply("!", LENGTH), "max_tokens", None)],
)  # fmt: skip
def test_the_stop_reason_says_why_the_answer_ended(last, reason, sequence):
    client, http = sdk(Scripted([reply("Hi"), last]))
    with http:
        message = client.messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
        )
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


CALL = inference_pb2.ToolCall(id="call_1", name="get_time", arguments='{"zone": "UTC"}')
TOOL_REPLIES = [
    reply(reasoning="Think."),
    reply(tool_calls=[inference_pb2.ToolCallDelta(index=0, id="call_1", name="get_time")]),
    reply(tool_calls=[inference_pb2.ToolCallDelta(index=0, arguments='{"zone": "UTC"}')]),
    reply(finish=common_pb2.FINISH_REASON_TOOL_CALLS, parsed=inference_pb2.ParsedChoice(
        reasoning="Think.", tool_calls=[CALL],
        finish_reason=common_pb2.FINISH_REASON_TOOL_CALLS)),
]  # fmt: skip
TOOLS = [{"name": "get_time", "description": "The time.",
          "input_schema": {"properties": {"zone": {"type": "string"}}}}]  # fmt: skip


def test_tools_and_their_results_travel_as_chat_tools_and_come_back_as_tool_use():
    processor = Scripted(TOOL_REPLIES)
    client, http = sdk(processor)
    history = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_0",
                                           "name": "get_time", "input": {"zone": "CET"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_0",
                                      "content": "12:00"}, {"type": "text", "text": "And?"}]},
    ]  # fmt: skip
    with http:
        message = client.messages.create(
            model="m", max_tokens=9, messages=history, tools=TOOLS,
            tool_choice={"type": "tool", "name": "get_time"},
        )  # fmt: skip
    request = processor.requests[0]
    roles = [m.role for m in request.messages]
    assert roles == [inference_pb2.ROLE_USER, inference_pb2.ROLE_ASSISTANT,
                     inference_pb2.ROLE_TOOL, inference_pb2.ROLE_USER]  # fmt: skip
    assert request.messages[1].tool_calls[0].arguments == '{"zone": "CET"}'
    assert request.messages[2].tool_call_id == "call_0"
    assert request.tools[0].name == "get_time" and request.tool_choice.function == "get_time"
    thinking, tool_use = message.content
    assert thinking.type == "thinking" and thinking.thinking == "Think."
    assert (tool_use.type, tool_use.id, tool_use.name) == ("tool_use", "call_1", "get_time")
    assert tool_use.input == {"zone": "UTC"} and message.stop_reason == "tool_use"


def test_a_stream_sends_anthropics_events_in_order():
    client, http = sdk(Scripted([TOOL_REPLIES[0], reply("Hel"), reply("lo"), *TOOL_REPLIES[1:]]))
    with (
        http,
        client.messages.stream(
            model="m", max_tokens=9, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS
        ) as stream,
    ):
        kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None))
                 for event in stream]  # fmt: skip
        final = stream.get_final_message()
    assert kinds[0] == ("message_start", None) and kinds[-1] == ("message_stop", None)
    blocks = [kind for kind in kinds if kind[0] == "content_block_start"]
    assert len(blocks) == 3
    assert ("content_block_delta", "signature_delta") in kinds
    assert ("content_block_delta", "input_json_delta") in kinds
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[1].text == "Hello" and final.content[2].input == {"zone": "UTC"}
    assert final.stop_reason == "tool_use" and final.usage.output_tokens == 3


def test_bad_requests_and_keys_get_anthropics_errors():
    processor = Scripted([reply("Hi", STOP)])
    client, http = sdk(processor, api_key="secret")
    with http:
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="m", max_tokens=0,
                                   messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
        error = bad.value.body["error"]
        assert bad.value.body == {"type": "error", "error": {
            "type": "invalid_request_error", "message": error["message"]}}  # fmt: skip
        assert "max_tokens" in bad.value.message
        wrong = anthropic.Anthropic(api_key="wrong", base_url=str(http.base_url),
                                    http_client=http, max_retries=0)  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model="m", max_tokens=2,
                                  messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
                "frobnicate": 1}  # fmt: skip
        raw = http.post("/v1/messages", json=body, headers={"x-api-key": "secret"})
        assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert processor.requests == []


def test_grpc_answers_as_rest_does():
    processor = Scripted([reply("Hel"), reply("lo", STOP)])
    service = messages_service(processor.chat).handlers
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}

    async def run() -> None:
        (whole,) = await rpc(service.CreateMessage, messages_pb2.CreateMessageRequest(
            request=json.dumps(body)))  # fmt: skip
        message = json.loads(whole.message)
        assert message["content"] == [{"type": "text", "text": "Hello"}]
        assert message["stop_reason"] == "end_turn"
        streamed = await rpc(service.CreateMessage, messages_pb2.CreateMessageRequest(
            request=json.dumps({**body, "stream": True})))  # fmt: skip
        kinds = [json.loads(reply.event)["type"] for reply in streamed]
        assert kinds == ["message_start", "content_block_start", "content_block_delta",
                         "content_block_delta", "content_block_stop", "message_delta",
                         "message_stop"]  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rpc(service.CreateMessage, messages_pb2.CreateMessageRequest(
                request=json.dumps({**body, "max_tokens": 0})))  # fmt: skip
        error = PrismError.from_rpc_error(refused.value)
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.param == "max_tokens"

    asyncio.run(run())


def test_count_tokens_renders_the_request_and_generates_nothing():
    processor = Scripted([])
    client, http = sdk(processor)
    with http:
        counted = client.messages.count_tokens(
            model="m", system="Be brief.", tools=TOOLS,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/a.png"}},
                {"type": "text", "text": "What is it?"}]}],
        )  # fmt: skip
    assert counted.input_tokens == 42
    (chat,) = processor.requests
    assert [m.role for m in chat.messages] == [inference_pb2.ROLE_SYSTEM, inference_pb2.ROLE_USER]
    assert chat.messages[1].content[0].image.url == "http://127.0.0.1/a.png"
    assert chat.tools[0].name == "get_time"
