"""Unit tests: OpenAI REST bodies to protobuf and back (no processes)."""

import base64
import json
import pickle

import grpc
import numpy as np
import pytest
import safetensors.numpy

from prism.gateway import bodies
from prism.gateway.openai import chat as chat_api
from prism.gateway.openai import completions, protocol, schemas
from prism.proto.v1 import common_pb2, errors_pb2, inference_pb2
from prism.rpc.errors import PrismError


def chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_chat_request_maps_parts_in_order():
    body = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}},
                    {"type": "text", "text": "b"},
                    {"type": "video_url", "video_url": {"url": "http://127.0.0.1/x.mp4"}},
                    {"type": "video_url", "video_url": "http://127.0.0.1/y.webm"},
                ],
            },
        ]
    )
    request = chat_api.chat_request(body, "rid")
    assert request.request_id == "rid"
    roles = [m.role for m in request.messages]
    assert roles == [inference_pb2.ROLE_SYSTEM, inference_pb2.ROLE_USER]
    parts = request.messages[1].content
    assert [p.WhichOneof("part") for p in parts] == ["text", "image", "text", "video", "video"]
    assert parts[1].image.url == "http://127.0.0.1/x.png"
    assert [parts[3].video.url, parts[4].video.url] == [
        "http://127.0.0.1/x.mp4",
        "http://127.0.0.1/y.webm",
    ]


def test_audio_parts_come_as_input_audio_or_audio_url():
    wav = b"RIFF\x00\x00\x00\x00WAVEfmt "
    body = chat(messages=[{"role": "user", "content": [
        {"type": "input_audio",
         "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1/a.mp3"}},
    ]}])  # fmt: skip
    first, second = chat_api.chat_request(body).messages[0].content
    assert (first.audio.data, first.audio.mime_type) == (wav, "audio/wav")
    assert second.audio.url == "http://127.0.0.1/a.mp3"


def _embeds_part(value) -> dict:
    body = chat(messages=[{"role": "user", "content": [{"type": "image_embeds",
                                                         "image_embeds": value}]}])  # fmt: skip
    return chat_api.chat_request(body).messages[0].content[0]


def test_image_embeds_parts_take_base64_safetensors_and_a_grid():
    array = np.ones((6, 8), np.float32)
    encoded = base64.b64encode(safetensors.numpy.save({"image_embeds": array})).decode()
    plain = _embeds_part(encoded).image_embedding
    assert (plain.dtype, list(plain.shape), plain.data) == ("float32", [6, 8], array.tobytes())
    for grid in ([1, 4, 6], [[1, 4, 6]]):
        gridded = _embeds_part({"image_embeds": encoded, "image_grid_thw": grid}).image_embedding
        assert list(gridded.image_grid_thw) == [1, 4, 6]
    pickled = base64.b64encode(pickle.dumps(array)).decode()
    bad_grid = {"image_embeds": encoded, "image_grid_thw": [1, -4, 6]}
    where = "messages[0].content[0].image_embeds"
    cases = [(pickled, "pickles", where), ("@@", "base64", where), (3, "str | object", where),
             (bad_grid, ">= 1", where + ".image_grid_thw")]  # fmt: skip
    for bad, message, param in cases:
        with pytest.raises(PrismError, match=message) as info:
            _embeds_part(bad)
        assert info.value.param == param


def sampling(**fields) -> common_pb2.SamplingParams:
    return protocol.sampling(bodies.typed(chat(**fields), schemas.ChatCompletionRequest))


def test_sampling_fields_are_carried():
    params = sampling(
        temperature=0, top_p=0.5, top_k=3, max_tokens=7, seed=11, stop="x",
        stop_token_ids=[2], ignore_eos=True, min_tokens=1, stream_interval=4,
    )  # fmt: skip
    assert params.HasField("temperature") and params.temperature == 0
    assert params.top_p == 0.5 and params.top_k == 3 and params.max_tokens == 7
    assert params.seed == 11 and list(params.stop) == ["x"] and list(params.stop_token_ids) == [2]
    assert params.ignore_eos and params.min_tokens == 1 and params.n == 1
    assert params.stream_interval == 4


def test_unset_sampling_fields_stay_unset():
    params = sampling()
    assert not params.HasField("temperature") and not params.HasField("max_tokens")


def test_max_completion_tokens_wins_over_max_tokens():
    assert sampling(max_tokens=5, max_completion_tokens=9).max_tokens == 9


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream_interval": 0}, "stream_interval"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
         "messages[0].tool_calls[0].function"),
        ({"messages": [{"role": "tool", "tool_call_id": 3, "content": "x"}]},
         "messages[0].tool_call_id"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].image_url"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
         "messages[0].content[0].video_url.url"),
        ({"model": 3}, "model"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "messages[0].content[0].input_audio"),
        ({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}]}]},
         "messages[0].content[0].input_audio.format"),
        ({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "%%", "format": "wav"}}]}]},
         "messages[0].content[0].input_audio.data"),
        ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {}}]}]},
         "messages[0].content[0].audio_url.url"),
    ],
)  # fmt: skip
def test_invalid_chat_fields_name_the_parameter(fields, param):
    with pytest.raises(PrismError) as info:
        chat_api.chat_request(chat(**fields))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.param == param
    assert info.value.http_status == 400


def test_null_fields_are_accepted():
    chat_api.chat_request(chat(tools=None, temperature=None, stop=None))


def test_completion_prompt_forms():
    assert completions.completion_request({"model": "m", "prompt": "hi"}).text == "hi"
    assert completions.completion_request({"model": "m", "prompt": ["hi"]}).text == "hi"
    ids = completions.completion_request({"model": "m", "prompt": [1, 2, 3]}).token_ids.ids
    assert list(ids) == [1, 2, 3]
    for bad in ("", [], ["a", "b"], [-1], None):
        with pytest.raises(PrismError):
            completions.completion_request({"model": "m", "prompt": bad})


def test_stream_options():
    def decoded(**fields) -> schemas.ChatCompletionRequest:
        return bodies.decode(json.dumps(chat(**fields)).encode(), schemas.ChatCompletionRequest)

    options = decoded(stream_options={"include_usage": True}).stream_options
    assert options.include_usage and not options.continuous_usage_stats
    assert decoded().stream_options is None
    for fields in ({"stream_options": "yes"}, {"stream": "true"}):
        with pytest.raises(PrismError) as info:
            decoded(**fields)
        assert info.value.param == next(iter(fields))


def test_finish_reasons_and_usage():
    assert protocol.finish_reason(common_pb2.FINISH_REASON_LENGTH) == "length"
    assert protocol.finish_reason(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    usage = common_pb2.Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7, cached_tokens=2)
    assert protocol.usage(usage) == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }  # fmt: skip


@pytest.mark.parametrize(
    "code,reason,status,kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "", 400, "invalid_request_error"),
        (grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED_MEDIA_TYPE", 415, "invalid_request_error"),
        (grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", 404, "invalid_request_error"),
        (grpc.StatusCode.UNAVAILABLE, "", 503, "server_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "OVERLOADED", 429, "rate_limit_error"),
        (grpc.StatusCode.INTERNAL, "", 500, "server_error"),
    ],
)
def test_error_body(code, reason, status, kind):
    named = errors_pb2.ErrorReason.Value(f"ERROR_REASON_{reason}") if reason else 0
    error = PrismError(code, "boom", reason=named, param="p")
    assert error.http_status == status
    body = protocol.error_body(error)["error"]
    assert body == {"message": "boom", "type": kind, "param": "p",
                    "code": (reason or code.name).lower()}  # fmt: skip


def test_logprobs_parameters():
    sampling = chat_api.chat_request(chat(logprobs=True, top_logprobs=3)).sampling
    assert sampling.logprobs == 3
    assert chat_api.chat_request(chat(logprobs=True)).sampling.logprobs == 0
    assert not chat_api.chat_request(chat(logprobs=False)).sampling.HasField("logprobs")
    body = {"model": "m", "prompt": "hi", "logprobs": 2, "echo": True, "prompt_logprobs": 1}
    request = completions.completion_request(body)
    assert (request.sampling.logprobs, request.sampling.prompt_logprobs, request.echo) == (
        2,
        1,
        True,
    )
    with pytest.raises(PrismError) as info:
        completions.completion_request({**body, "stream": True})
    assert info.value.param == "prompt_logprobs"


def test_structured_output_forms():
    def structured(**fields):
        return chat_api.chat_request(chat(**fields)).sampling.structured_output

    schema = {"type": "object"}
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert structured(response_format=form).json_schema == '{"type": "object"}'
    assert structured(response_format={"type": "json_object"}).json_object
    assert structured(response_format={"type": "text"}).WhichOneof("kind") is None
    assert structured(structured_outputs={"json": '{"type": "object"}'}).json_schema
    assert list(structured(structured_outputs={"choice": ["a", "b"]}).choice.choices) == ["a", "b"]
    assert structured(structured_outputs={"regex": "a+"}).regex == "a+"
    assert structured(structured_outputs={"grammar": "root ::= x"}).grammar == "root ::= x"


def test_logit_bias_is_clamped_as_vllm_clamps_it():
    sampling = chat_api.chat_request(chat(logit_bias={"5": 300, "7": -1.5})).sampling
    assert dict(sampling.logit_bias) == {5: 100.0, 7: -1.5}


def test_an_unserved_constraint_error_names_what_the_client_sent():
    error = PrismError(grpc.StatusCode.INVALID_ARGUMENT, "bad", param="structured_output")
    for sent in ({"response_format": {"type": "text"}}, {"structured_outputs": {"regex": "a"}}):
        body = bodies.typed(chat(**sent), schemas.ChatCompletionRequest)
        assert protocol.as_sent(error, body).param == next(iter(sent))


def _position(token, logprob, rank, *top):
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(
            token_id=token[0], token=token[1], logprob=logprob, rank=rank
        ),
        top=[common_pb2.TokenLogprob(token_id=i, token=t, logprob=lp, rank=r + 1)
             for r, (i, t, lp) in enumerate(top)],
    )  # fmt: skip


def test_chat_logprobs_list_the_drawn_token_first_as_vllm_does():
    # Drawn at rank 3: vLLM lists it first, then the top tokens, without repeats.
    position = _position((9, "c"), -2.0, 3, (1, "a", -0.5), (2, "b", -1.0), (9, "c", -2.0))
    body = chat_api.chat_logprobs([position], 2)
    (entry,) = body["content"]
    assert (entry["token"], entry["logprob"], entry["bytes"]) == ("c", -2.0, [99])
    assert [t["token"] for t in entry["top_logprobs"]] == ["c", "a"]
    minus_infinity = _position((4, "é"), float("-inf"), 1500)
    (entry,) = chat_api.chat_logprobs([minus_infinity], 0)["content"]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"] == []
    assert entry["bytes"] == [0xC3, 0xA9]


def test_completion_logprobs_offsets_and_the_unscored_first_prompt_token():
    first = common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=3, token="Hi"))
    second = _position((5, " there"), -1.0, 2, (6, "!", -0.5), (5, " there", -1.0))
    body = completions.completion_logprobs([first, second], 1, text_offset=10)
    assert body["tokens"] == ["Hi", " there"]
    assert body["text_offset"] == [10, 12]
    assert body["token_logprobs"] == [None, -1.0]
    # The asked number plus the token itself.
    assert body["top_logprobs"] == [None, {" there": -1.0, "!": -0.5}]
    assert completions.prompt_logprobs([first, second]) == [
        None,
        {"5": {"logprob": -1.0, "rank": 2, "decoded_token": " there"},
         "6": {"logprob": -0.5, "rank": 1, "decoded_token": "!"}},
    ]  # fmt: skip


def test_tools_and_calls_reach_the_processor_as_typed_fields():
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    request = chat_api.chat_request(chat(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": weather,
                                                 "strict": True}},
               {"type": "function", "function": {"name": "now", "description": "The time."}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    ))  # fmt: skip
    assistant, tool = request.messages[1], request.messages[2]
    assert assistant.role == inference_pb2.ROLE_ASSISTANT and not assistant.content
    (call,) = assistant.tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert tool.role == inference_pb2.ROLE_TOOL and tool.tool_call_id == "call_1"
    first, second = request.tools
    assert first.name == "get_weather" and first.strict and not first.HasField("description")
    assert json.loads(first.parameters) == weather
    assert second.description == "The time." and not second.parameters
    assert not second.HasField("strict")
    assert request.tool_choice.function == "get_weather"
    assert request.HasField("parallel_tool_calls") and not request.parallel_tool_calls
    modes = {m: chat_api.chat_request(chat(tool_choice=m)).tool_choice.mode
             for m in ("none", "auto", "required")}  # fmt: skip
    assert modes == {"none": inference_pb2.TOOL_CHOICE_MODE_NONE,
                     "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
                     "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED}  # fmt: skip
    assert not chat_api.chat_request(chat()).HasField("tool_choice")


def test_streamed_deltas_carry_content_reasoning_and_calls_as_vllm_streams_them():
    reply = inference_pb2.ChatResponse
    call = inference_pb2.ToolCallDelta
    assert chat_api.chat_delta(reply(text="Hi")) == {"content": "Hi"}
    assert chat_api.chat_delta(reply()) == {"content": ""}
    assert chat_api.chat_delta(reply(reasoning="hm")) == {
        "reasoning": "hm", "reasoning_content": "hm"}  # fmt: skip
    started = reply(tool_calls=[call(index=0, id="chatcmpl-tool-1", name="f"),
                                call(index=0, arguments='{"a"')])  # fmt: skip
    assert chat_api.chat_delta(started) == {"content": None, "tool_calls": [
        {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f"}},
        {"index": 0, "function": {"arguments": '{"a"'}},
    ]}  # fmt: skip
    assert protocol.finish_reason(common_pb2.FINISH_REASON_TOOL_CALLS) == "tool_calls"


def test_a_parsed_choice_is_the_whole_message():
    parsed = inference_pb2.ParsedChoice(
        reasoning="first", tool_calls=[inference_pb2.ToolCall(id="x", name="f", arguments="{}")]
    )
    assert chat_api.chat_message(parsed) == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "x", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}],
        "reasoning": "first", "reasoning_content": "first",
    }  # fmt: skip
    plain = chat_api.chat_message(inference_pb2.ParsedChoice(content=""))
    assert plain == {"role": "assistant", "content": "", "reasoning": None,
                     "reasoning_content": None}  # fmt: skip
    assert protocol.usage(common_pb2.Usage(reasoning_tokens=3))["completion_tokens_details"] == {
        "reasoning_tokens": 3}  # fmt: skip
