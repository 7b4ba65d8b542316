"""SSE chunks of plain text are written from bytes made once per request: byte for byte
what the general path (a dict, then JSON) writes, whatever the text, the finish and the
stream options."""

import asyncio

import pytest

from prism import telemetry
from prism.gateway.openai.chat import ChatAnswer
from prism.gateway.openai.completions import CompletionAnswer
from prism.gateway.openai.schemas import StreamOptions
from prism.gateway.streaming import _events
from prism.proto.v1 import common_pb2, inference_pb2

TEXTS = ["", "a", ' "quoted" \\ back', "tab\tnew\nline", "é ü 中文 🙂", "\x00\x1f"]
OPTIONS = [
    StreamOptions(),
    StreamOptions(include_usage=True),
    StreamOptions(include_usage=True, continuous_usage_stats=True),
]


class General:
    """An answer that never writes plain bytes: the general path alone."""

    def __init__(self, answer):
        self.answer = answer

    def chunk(self, reply, first):
        return self.answer.chunk(reply, first)

    def plain(self, reply, first):
        return None


class Call:
    def ready(self):
        return None

    def cancel(self):
        pass


def stream(answer, replies, options) -> bytes:
    async def rest():
        for reply in replies[1:]:
            yield reply

    async def read() -> bytes:
        timer = telemetry.RequestTimer("/test")
        events = _events(Call(), replies[0], rest(), timer, options, answer)
        return b"".join([chunk async for chunk in events])

    return asyncio.run(read())


def replies(kind, model: str) -> list:
    out = []
    for i, text in enumerate(TEXTS):
        usage = common_pb2.Usage(prompt_tokens=7, completion_tokens=i + 1, total_tokens=i + 8)
        end = i == len(TEXTS) - 1
        reason = common_pb2.FINISH_REASON_LENGTH if end else common_pb2.FINISH_REASON_UNSPECIFIED
        out.append(kind(text=text, index=i % 2, model=model, usage=usage, finish_reason=reason))
    return out


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "usage", "continuous"])
@pytest.mark.parametrize("model", ["m", 'mödel "x"'])
def test_chat_chunks_of_plain_text_are_the_general_paths_bytes(options, model):
    messages = replies(inference_pb2.ChatResponse, model)
    params = common_pb2.SamplingParams()
    fast = stream(ChatAnswer("chatcmpl-1", params), messages, options)
    answer = ChatAnswer("chatcmpl-1", params)
    assert fast == stream(General(answer), messages, options)
    assert answer.plain(messages[0], first=True) is None  # the first carries the role


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "usage", "continuous"])
def test_completion_chunks_of_plain_text_are_the_general_paths_bytes(options):
    messages = replies(inference_pb2.CompleteResponse, "m")
    params = common_pb2.SamplingParams()
    fast = stream(CompletionAnswer("cmpl-1", params), messages, options)
    assert fast == stream(General(CompletionAnswer("cmpl-1", params)), messages, options)


def test_what_is_more_than_text_takes_the_general_path():
    chat = ChatAnswer("c", common_pb2.SamplingParams())
    assert chat.plain(inference_pb2.ChatResponse(text="a", reasoning="r"), False) is None
    call = inference_pb2.ToolCallDelta(index=0, name="f")
    assert chat.plain(inference_pb2.ChatResponse(tool_calls=[call]), False) is None
    logprobs = ChatAnswer("c", common_pb2.SamplingParams(logprobs=2))
    assert logprobs.plain(inference_pb2.ChatResponse(text="a"), False) is None
    completion = CompletionAnswer("c", common_pb2.SamplingParams(logprobs=1))
    assert completion.plain(inference_pb2.CompleteResponse(text="a"), False) is None
