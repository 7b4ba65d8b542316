"""The Responses API in the gateway alone, before a processor that answers from a script:
the chat request each body becomes, the response and events written from the replies, the
store behind previous_response_id, errors naming the field as sent, and the same over gRPC
(called in this process)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator

import grpc
import pytest
from fastapi.testclient import TestClient
from support.scripted import Call, Scripted, rpc

from prism.gateway.app import create_app
from prism.gateway.client import LocalCall
from prism.gateway.openai.responses.respond import Responder
from prism.gateway.openai.responses.rpc import responses_service
from prism.gateway.openai.responses.store import ResponseStore, Stored
from prism.proto.v1 import common_pb2, inference_pb2, responses_pb2
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError

USAGE = common_pb2.Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


def reply(text: str = "", finish: int = 0, **fields) -> inference_pb2.ChatResponse:
    return inference_pb2.ChatResponse(text=text, finish_reason=finish, model="m", usage=USAGE,
                                      **fields)  # fmt: skip


HELLO = [reply("Hel"), reply("lo", STOP)]
# A request whose only item has no type the Responses API knows.
BAD_ITEM = json.dumps({"model": "m", "input": [{"type": 1}]})


def client(processor: Scripted, store: ResponseStore | None = None) -> TestClient:
    app = create_app(Router(StaticRegistry({})), processor=processor, stored=store)
    return TestClient(app)


def texts(message: inference_pb2.ChatMessage) -> list[str]:
    return [part.text for part in message.content]


def test_a_string_input_after_instructions_is_a_chat_of_two():
    processor = Scripted(HELLO)
    with client(processor) as c:
        body = c.post(
            "/v1/responses",
            json={
                "model": "m",
                "input": "Hi",
                "instructions": "Be.",
                "max_output_tokens": 5,
                "temperature": 0,
            },
        ).json()
    (request,) = processor.requests
    assert [m.role for m in request.messages] == [
        inference_pb2.ROLE_SYSTEM,
        inference_pb2.ROLE_USER,
    ]
    assert texts(request.messages[1]) == ["Hi"]
    assert request.sampling.max_tokens == 5 and request.sampling.temperature == 0
    assert body["object"] == "response" and body["status"] == "completed"
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": [],
                                   "logprobs": None}]  # fmt: skip
    usage = body["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (7, 3, 10)
    assert usage["input_tokens_details"]["cached_tokens"] == 0
    assert usage["output_tokens_details"]["reasoning_tokens"] == 0


def test_items_become_messages_as_vllm_builds_them():
    processor = Scripted(HELLO)
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": "https://x/a.png"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ]  # fmt: skip
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    with client(processor) as c:
        reply_ = c.post(
            "/v1/responses",
            json={
                "model": "m",
                "input": items,
                "tools": [tool],
                "tool_choice": {"type": "function", "name": "f"},
            },
        )
    assert reply_.status_code == 200, reply_.text
    (request,) = processor.requests
    user, assistant, tool_message = request.messages
    assert user.content[1].image.url == "https://x/a.png"
    # Both calls are one assistant message's.
    assert [call.id for call in assistant.tool_calls] == ["c1", "c2"]
    assert tool_message.tool_call_id == "c1" and texts(tool_message) == ["done"]
    assert request.tools[0].name == "f" and request.tool_choice.function == "f"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].image_url"),
        ({"input": ["x", {"role": "user", "content": "a"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
         "input[1].content[0].image_url.url"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
        ({"input": []}, "input"),
        ({"input": "x", "previous_response_id": "resp_gone"}, "previous_response_id"),
        ({"input": "x", "stream": "yes"}, "stream"),
        ({"input": "x", "store": "no"}, "store"),
    ],
)  # fmt: skip
def test_a_bad_request_names_its_field_and_calls_nothing(body, param):
    processor = Scripted(HELLO)
    with client(processor) as c:
        answer = c.post("/v1/responses", json={"model": "m", **body})
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.json()["error"]["param"] == param
    assert processor.requests == []


def test_a_follow_up_sees_the_first_turn_and_get_and_delete_find_it():
    processor = Scripted(HELLO)
    with client(processor) as c:
        first = c.post(
            "/v1/responses", json={"model": "m", "input": "Hi", "instructions": "Be."}
        ).json()
        c.post(
            "/v1/responses",
            json={"model": "m", "input": "More", "previous_response_id": first["id"]},
        )
        assert c.get(f"/v1/responses/{first['id']}").json() == first
        cancelled = c.post(f"/v1/responses/{first['id']}/cancel")
        assert cancelled.status_code == 400 and "synchronous" in cancelled.text
        assert c.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
        gone = c.get(f"/v1/responses/{first['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"
        unkept = c.post("/v1/responses", json={"model": "m", "input": "x", "store": False}).json()
        assert c.get(f"/v1/responses/{unkept['id']}").status_code == 404
    follow_up = processor.requests[1]
    # The first turn's instructions do not carry over; its answer does.
    assert [(m.role, texts(m)) for m in follow_up.messages] == [
        (inference_pb2.ROLE_USER, ["Hi"]),
        (inference_pb2.ROLE_ASSISTANT, ["Hello"]),
        (inference_pb2.ROLE_USER, ["More"]),
    ]


def test_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResponseStore(2, ttl_s=10, timer=lambda: now[0])
    for n in range(3):
        store.put(Stored({"id": f"r{n}"}, []))
    with pytest.raises(Exception, match="r0"):
        store.get("r0")
    assert store.get("r2").response == {"id": "r2"}
    now[0] = 11
    with pytest.raises(Exception, match="r2"):
        store.get("r2")


def test_the_store_is_bounded_in_bytes_the_newest_kept():
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x" * 400}}]}
    store = ResponseStore(10, max_bytes=1000)
    for n in range(3):
        store.put(Stored({"id": f"r{n}"}, [image]))
    # About 450 bytes each: the two newest fit.
    with pytest.raises(Exception, match="r0"):
        store.get("r0")
    assert [store.get(f"r{n}").response for n in (1, 2)] == [{"id": "r1"}, {"id": "r2"}]
    store.put(Stored({"id": "huge"}, [image] * 3))
    with pytest.raises(Exception, match="huge"):
        store.get("huge")
    assert store.get("r2").response == {"id": "r2"}


def test_fronts_that_share_a_store_file_find_each_others_responses(tmp_path):
    path = str(tmp_path / "responses.sqlite3")
    one, other = ResponseStore(10, 60, path), ResponseStore(10, 60, path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    one.put(Stored({"id": "r1"}, [{"role": "user", "content": "Hi"}]))
    assert other.get("r1") == Stored({"id": "r1"}, [{"role": "user", "content": "Hi"}])
    other.delete("r1")
    with pytest.raises(Exception, match="r1"):
        one.get("r1")


def events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


# The events of a stream of two replies.
TWO_DELTAS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta",
    "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done", "response.completed",
]  # fmt: skip


def test_a_stream_sends_vllms_events_in_order_and_completes_with_the_items():
    processor = Scripted([reply("Hel"), reply("lo", LENGTH)])
    with client(processor) as c:
        streamed = c.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True})
        sent = events(streamed.text)
        stored = c.get(f"/v1/responses/{sent[-1]['response']['id']}").json()
    assert [e["type"] for e in sent] == TWO_DELTAS
    assert [e["sequence_number"] for e in sent] == list(range(len(sent)))
    assert [e["delta"] for e in sent if e["type"].endswith(".delta")] == ["Hel", "lo"]
    final = sent[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"] == [sent[-2]["item"]] and stored == final


def test_reasoning_and_tool_calls_are_items_of_their_own():
    call = inference_pb2.ToolCall(id="call_9", name="f", arguments='{"a": 1}')
    parsed = inference_pb2.ParsedChoice(reasoning="think", tool_calls=[call], finish_reason=STOP)
    deltas = [
        reply(reasoning="think"),
        reply(tool_calls=[inference_pb2.ToolCallDelta(index=0, id="call_9", name="f")]),
        reply(tool_calls=[inference_pb2.ToolCallDelta(index=0, arguments='{"a": 1}')],
              finish=STOP, parsed=parsed),
    ]  # fmt: skip
    with client(Scripted(deltas)) as c:
        whole = c.post("/v1/responses", json={"model": "m", "input": "Hi"}).json()
        sent = events(c.post("/v1/responses", json={"model": "m", "input": "Hi",
                                                     "stream": True}).text)  # fmt: skip
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "function_call"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    # vLLM's whole answer gives its reasoning item no status; its stream's is "completed".
    assert whole["output"][0]["status"] is None
    call_item = whole["output"][1]
    assert (call_item["call_id"], call_item["name"], call_item["arguments"]) == (
        "call_9",
        "f",
        '{"a": 1}',
    )
    done = [e["item"] for e in sent if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == kinds
    assert done[0]["status"] == "completed"
    assert done[1]["arguments"] == '{"a": 1}'
    assert "response.function_call_arguments.done" in [e["type"] for e in sent]


def test_grpc_answers_as_rest_does_and_shares_its_store():
    processor = Scripted(HELLO)
    store = ResponseStore()
    service = responses_service(Responder(store, processor.chat)).handlers

    async def run() -> None:
        whole = await rpc(service.Respond, responses_pb2.RespondRequest(
            request=json.dumps({"model": "m", "input": "Hi"})))  # fmt: skip
        (first,) = [json.loads(r.response) for r in whole]
        assert first["output"][0]["content"][0]["text"] == "Hello"
        with client(processor, store) as c:
            assert c.get(f"/v1/responses/{first['id']}").json() == first
        streamed = await rpc(service.Respond, responses_pb2.RespondRequest(request=json.dumps(
            {"model": "m", "input": "More", "stream": True, "previous_response_id": first["id"]}
        )))  # fmt: skip
        assert [json.loads(r.event)["type"] for r in streamed] == TWO_DELTAS
        got = await rpc(service.GetResponse, responses_pb2.GetResponseRequest(
            response_id=first["id"]))  # fmt: skip
        assert json.loads(got[0].response) == first
        await rpc(service.DeleteResponse, responses_pb2.DeleteResponseRequest(
            response_id=first["id"]))  # fmt: skip
        for call, request in (
            (service.GetResponse, responses_pb2.GetResponseRequest(response_id=first["id"])),
            (service.Respond, responses_pb2.RespondRequest(request="{")),
            (service.Respond, responses_pb2.RespondRequest(request=BAD_ITEM)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rpc(call, request)
            error = PrismError.from_rpc_error(refused.value)
            assert error.param in ("response_id", "request", "input[0].type"), error

    asyncio.run(run())
    # The follow-up saw the first turn.
    assert [texts(m) for m in processor.requests[1].messages] == [["Hi"], ["Hello"], ["More"]]


class Endless(Call):
    """A call that sends its replies, then waits for ever; it knows if it was cancelled."""

    cancelled = False

    async def _each(self) -> AsyncIterator:
        for message in self.replies:
            yield message
        await asyncio.Event().wait()

    def cancel(self) -> bool:
        self.cancelled = True
        return True


@pytest.mark.parametrize("stream", [True, False])
def test_a_grpc_caller_gone_cancels_the_generation(stream):
    calls: list[Endless] = []

    def chat(request: inference_pb2.ChatRequest) -> Endless:
        calls.append(Endless([reply("Hel")]))
        return calls[-1]

    service = responses_service(Responder(ResponseStore(), chat)).handlers
    body = json.dumps({"model": "m", "input": "Hi", "stream": stream})

    async def run() -> None:
        call = LocalCall(service.Respond, responses_pb2.RespondRequest(request=body), None)
        if stream:
            await call.__anext__()
        else:
            # The first reply is in, the rest never comes.
            while not calls:
                await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        call.cancel()
        for _ in range(10):
            await asyncio.sleep(0)

    asyncio.run(run())
    assert calls[0].cancelled
