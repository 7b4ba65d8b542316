"""Tools and reasoning in the processor, with the tiny LLaVA's tokenizer and no model:
vLLM's checks and tool schemas, the constraint of a forced call, the chat template's tools
and calls, and outputs split by vLLM's parsers, streamed and whole."""

import asyncio
import json

import pytest
from test_processor import handle

from prism.devtools.tiny_models import llava_tokenizer
from prism.engine.parsing import ChatParsing, Parsers
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import PrismError

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
TOOL_CALLS = common_pb2.FINISH_REASON_TOOL_CALLS
MODE = inference_pb2.ToolChoiceMode
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
WEATHER = inference_pb2.Tool(name="get_weather", parameters=json.dumps(SCHEMA), strict=True)
CLOCK = inference_pb2.Tool(name="get_time", description="The time.")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return llava_tokenizer()


@pytest.fixture(scope="module")
def parsers(tokenizer):
    return Parsers.of(tokenizer, "hermes", "deepseek_r1", enable_auto_tools=True)


def _request(choice: inference_pb2.ToolChoice | None = None, **fields) -> inference_pb2.ChatRequest:
    request = inference_pb2.ChatRequest(tools=[WEATHER, CLOCK], **fields)
    if choice is not None:
        request.tool_choice.CopyFrom(choice)
    return request


def _mode(mode: int) -> inference_pb2.ToolChoice:
    return inference_pb2.ToolChoice(mode=mode)


def test_parsers_are_named_as_vllm_names_them(tokenizer):
    assert Parsers.of(tokenizer).parser_cls is None
    hermes = Parsers.of(tokenizer, "hermes", enable_auto_tools=True)
    assert hermes.tools and not hermes.reasoning
    # As vLLM: without --enable-auto-tool-choice there is no tool parser at all.
    assert not Parsers.of(tokenizer, "hermes").tools
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        Parsers.of(tokenizer, enable_auto_tools=True)
    with pytest.raises(ValueError):
        Parsers.of(tokenizer, "no_such_parser", enable_auto_tools=True)


@pytest.mark.parametrize(
    ("request_", "server", "param", "message"),
    [
        (inference_pb2.ChatRequest(tool_choice=_mode(MODE.TOOL_CHOICE_MODE_REQUIRED)), True,
         "tool_choice", "`tools` must be set"),
        (_request(inference_pb2.ToolChoice(function="get_nothing")), True, "tool_choice",
         "does not match any"),
        (_request(), False, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
        (_request(_mode(MODE.TOOL_CHOICE_MODE_REQUIRED)), False, "tool_choice",
         'tool_choice="required" requires --tool-call-parser'),
        (_request(inference_pb2.ToolChoice(function="get_time")), False, "tool_choice",
         'tool_choice=function "get_time" requires'),
        (inference_pb2.ChatRequest(tools=[inference_pb2.Tool(name="f", parameters="{")]), True,
         "tools", "not JSON"),
    ],
)  # fmt: skip
def test_what_vllm_refuses_is_refused_naming_the_parameter(
    tokenizer, parsers, request_, server, param, message
):
    with pytest.raises(PrismError) as info:
        ChatParsing.of(parsers if server else Parsers(), tokenizer, request_)
    assert info.value.param == param and message in info.value.message


def test_the_template_sees_tools_as_vllm_dumps_them(tokenizer, parsers):
    # Also with tool_choice none, as vLLM's server does by default.
    parsing = ChatParsing.of(parsers, tokenizer, _request(_mode(MODE.TOOL_CHOICE_MODE_NONE)))
    assert parsing.tool_dicts == [
        {"type": "function", "function": {"name": "get_weather", "description": None,
                                          "parameters": SCHEMA, "strict": True}},
        {"type": "function", "function": {"name": "get_time", "description": "The time.",
                                          "parameters": None}},
    ]  # fmt: skip


def test_a_forced_call_is_held_to_the_parsers_format(tokenizer, parsers):
    forced = ChatParsing.of(parsers, tokenizer, _request(_mode(MODE.TOOL_CHOICE_MODE_REQUIRED)))
    sampling = common_pb2.SamplingParams()
    forced.adjust(sampling)
    tag = json.loads(sampling.structured_output.structural_tag)
    begins = {t["begin"] for t in tag["format"]["tags"]}
    assert '<tool_call>{"name": "get_time", "arguments": ' in begins
    assert sampling.skip_special_tokens is False
    # Auto with a tool that is not strict leaves the output free.
    free = ChatParsing.of(
        Parsers.of(tokenizer, "hermes", enable_auto_tools=True), tokenizer,
        inference_pb2.ChatRequest(tools=[CLOCK]),
    )  # fmt: skip
    sampling = common_pb2.SamplingParams()
    free.adjust(sampling)
    assert not sampling.HasField("structured_output")


def _stream(parsing: ChatParsing, tokenizer, text: str, reason: int):
    """`text` through one choice's parser a token at a time, as the detokenizer hands it."""
    choice = parsing.choice()
    ids = tokenizer.encode(text, add_special_tokens=False)
    steps, before = [], ""
    for i, token in enumerate(ids):
        decoded = tokenizer.decode(ids[: i + 1])
        step = choice.step(decoded[len(before) :], [token], i == len(ids) - 1)
        before = decoded
        if step is not None:
            steps.append(step)
    return steps, choice.finish_reason(reason), choice.whole(reason)


def _joined(steps) -> tuple[str, str, dict[int, list[str]]]:
    calls: dict[int, list[str]] = {}
    for step in steps:
        for call in step.tool_calls:
            entry = calls.setdefault(call.index, ["", "", ""])
            entry[0] += call.id
            entry[1] += call.name
            entry[2] += call.arguments
    return "".join(s.content for s in steps), "".join(s.reasoning for s in steps), calls


def test_reasoning_and_calls_are_split_streamed_and_whole(tokenizer, parsers):
    parsing = ChatParsing.of(parsers, tokenizer, _request(_mode(MODE.TOOL_CHOICE_MODE_REQUIRED)))
    text = "Paris, I think.</think>" + CALL + CALL.replace("Paris", "Paris ")
    steps, streamed_reason, whole = _stream(parsing, tokenizer, text, STOP)
    content, reasoning, calls = _joined(steps)
    assert (content, reasoning) == ("", "Paris, I think.")
    assert [(name, args) for _, name, args in calls.values()] == [
        ("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Paris "}')]  # fmt: skip
    assert all(call_id.startswith("chatcmpl-tool-") for call_id, _, _ in calls.values())
    assert streamed_reason == TOOL_CALLS
    # Whole: arguments written anew, and content "" rather than none where a call is forced.
    assert (whole.content, whole.reasoning) == ("", "Paris, I think.")
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris "}')]  # fmt: skip
    assert whole.finish_reason == TOOL_CALLS


def test_finish_reasons_follow_vllm_per_tool_choice(tokenizer, parsers):
    choice = inference_pb2.ToolChoice(function="get_weather")
    named = ChatParsing.of(parsers, tokenizer, _request(choice))
    _, reason, whole = _stream(named, tokenizer, "</think>" + CALL, STOP)
    assert reason == STOP and whole.finish_reason == STOP and len(whole.tool_calls) == 1
    # Auto, cut short by the length: whole says tool_calls, streamed says length.
    auto = ChatParsing.of(parsers, tokenizer, _request())
    _, reason, whole = _stream(auto, tokenizer, "</think>" + CALL, LENGTH)
    assert reason == LENGTH and whole.finish_reason == TOOL_CALLS
    # None: the call stays text.
    none = ChatParsing.of(parsers, tokenizer, _request(_mode(MODE.TOOL_CHOICE_MODE_NONE)))
    steps, reason, whole = _stream(none, tokenizer, "</think>" + CALL, STOP)
    assert reason == STOP and not whole.tool_calls and whole.content == CALL
    assert _joined(steps)[0] == CALL


def test_one_call_only_when_parallel_calls_are_off(tokenizer, parsers):
    request = _request(_mode(MODE.TOOL_CHOICE_MODE_REQUIRED), parallel_tool_calls=False)
    parsing = ChatParsing.of(parsers, tokenizer, request)
    steps, _, whole = _stream(parsing, tokenizer, "</think>" + CALL + CALL, STOP)
    assert list(_joined(steps)[2]) == [0] and len(whole.tool_calls) == 1


def test_reasoning_without_its_end_is_all_reasoning(tokenizer, parsers):
    parsing = ChatParsing.of(parsers, tokenizer, inference_pb2.ChatRequest())
    steps, reason, whole = _stream(parsing, tokenizer, "Hmm, let me see.", LENGTH)
    assert _joined(steps)[:2] == ("", "Hmm, let me see.") and reason == LENGTH
    assert not whole.HasField("content") and whole.reasoning == "Hmm, let me see."


def test_chat_with_tools_templates_them_and_streams_parsed_parts(tokenizer, parsers):
    assistant = inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_ASSISTANT,
        tool_calls=[inference_pb2.ToolCall(id="c1", name="get_weather", arguments="not json")],
    )
    tool = inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_TOOL, tool_call_id="c1",
        content=[inference_pb2.ContentPart(text="Sunny"), inference_pb2.ContentPart(text="20 C")],
    )  # fmt: skip
    user = inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text="Weather?")]
    )
    request = _request(_mode(MODE.TOOL_CHOICE_MODE_REQUIRED), messages=[user, assistant, tool])
    (replies,), pipeline = asyncio.run(handle(
        tokenizer, "Sure.</think>" + CALL, lambda h: h.chat(request), max_model_len=2048,
        parsers=parsers,
    ))  # fmt: skip
    ((_, prompt),) = pipeline.requests
    templated = tokenizer.decode(prompt)
    assert '{"name": "get_weather", "description": null' in templated
    # As vLLM: arguments that are not JSON go to the template as {}; a tool's parts as lines.
    assert '"arguments": {}}' in templated and "Sunny\n20 C" in templated
    (sampling,) = pipeline.sampling
    assert sampling.structured_output.structural_tag and sampling.skip_special_tokens is False
    assert "".join(r.reasoning for r in replies) == "Sure."
    assert "".join(r.text for r in replies) == ""
    names = [call.name for r in replies for call in r.tool_calls if call.name]
    assert names == ["get_weather"]
    # Every token is handed out, also those the parsers held back.
    assert [t for r in replies for t in r.token_ids] == pipeline.answer
    last = replies[-1]
    assert last.finish_reason == LENGTH and last.parsed.finish_reason == LENGTH
    assert [c.arguments for c in last.parsed.tool_calls] == ['{"city": "Paris"}']
    assert all(not r.HasField("parsed") for r in replies[:-1])
