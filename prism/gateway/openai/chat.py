"""POST /v1/chat/completions: an OpenAI chat request as the processor's `ChatRequest`
(messages, content parts, tools), and its answer as vLLM's OpenAI server writes it."""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from prism.gateway import bodies
from prism.gateway.client import ProcessorClient
from prism.gateway.openai import schemas
from prism.gateway.openai.protocol import (
    finish_reason,
    logprob,
    position_tokens,
    sampling,
    usage,
)
from prism.gateway.streaming import PlainChunks, respond
from prism.media import embeds
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import invalid

router = APIRouter()

ROLES = {
    "system": inference_pb2.ROLE_SYSTEM,
    "user": inference_pb2.ROLE_USER,
    "assistant": inference_pb2.ROLE_ASSISTANT,
    "developer": inference_pb2.ROLE_DEVELOPER,
    "tool": inference_pb2.ROLE_TOOL,
}
# OpenAI's `input_audio` formats, as MIME types (the processor checks them against the
# bytes).
AUDIO_FORMATS = {"wav": "audio/wav", "mp3": "audio/mpeg", "flac": "audio/flac",
                 "ogg": "audio/ogg", "m4a": "audio/mp4", "webm": "audio/webm"}  # fmt: skip
TOOL_CHOICES = {
    "none": inference_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED,
}


def _url(value: str | schemas.MediaUrl) -> str:
    """The URL of an `image_url`, `video_url` or `audio_url` part: {"url": ...}, or the
    string itself."""
    return value if isinstance(value, str) else value.url


def _input_audio_part(value: schemas.InputAudio, param: str) -> inference_pb2.ContentPart:
    """OpenAI's form: {"input_audio": {"data": base64 of the file, "format": "wav"|...}}."""
    try:
        data = base64.b64decode(value.data, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("input_audio data is not valid base64", f"{param}.data") from None
    audio = common_pb2.Audio(data=data, mime_type=AUDIO_FORMATS[value.format])
    return inference_pb2.ContentPart(audio=audio)


def _image_embeds_part(value: str | schemas.ImageEmbeds, param: str) -> inference_pb2.ContentPart:
    """vLLM's form: base64 (here: of a safetensors file, never a pickle), or for the
    Qwen2-VL family {"image_embeds": base64, "image_grid_thw": [t, h, w]}."""
    grid = None
    if isinstance(value, schemas.ImageEmbeds):
        value, grid = value.image_embeds, value.image_grid_thw
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("image_embeds is not valid base64", param) from None
    embedding = embeds.from_safetensors(data, param)
    if grid is not None:
        # vLLM takes (3,) per image; (1, 3) is the same grid as a batch of one.
        if len(grid) == 1 and isinstance(grid[0], list):
            grid = grid[0]
        if not all(isinstance(v, int) for v in grid):
            raise invalid("image_grid_thw must be a list of positive integers", param)
        embedding.image_grid_thw.extend(grid)
    return inference_pb2.ContentPart(image_embedding=embedding)


def _part(part: schemas.ContentPart, where: str) -> inference_pb2.ContentPart:
    if isinstance(part, schemas.TextPart):
        return inference_pb2.ContentPart(text=part.text)
    if isinstance(part, schemas.ImageUrlPart):
        return inference_pb2.ContentPart(image=common_pb2.Image(url=_url(part.image_url)))
    if isinstance(part, schemas.VideoUrlPart):
        return inference_pb2.ContentPart(video=common_pb2.Video(url=_url(part.video_url)))
    if isinstance(part, schemas.AudioUrlPart):
        return inference_pb2.ContentPart(audio=common_pb2.Audio(url=_url(part.audio_url)))
    if isinstance(part, schemas.InputAudioPart):
        return _input_audio_part(part.input_audio, f"{where}.input_audio")
    return _image_embeds_part(part.image_embeds, f"{where}.image_embeds")


def _content(content: str | list | None, param: str) -> list[inference_pb2.ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [inference_pb2.ContentPart(text=content)]
    return [_part(part, f"{param}[{j}]") for j, part in enumerate(content)]


def _tool_call(call: schemas.ToolCall) -> inference_pb2.ToolCall:
    """An assistant message's tool call: arguments as JSON text (an object is written as
    such)."""
    arguments = call.function.arguments
    if isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return inference_pb2.ToolCall(id=call.id or "", name=call.function.name,
                                  arguments=arguments or "")  # fmt: skip


def _tool(tool: schemas.Tool) -> inference_pb2.Tool:
    function = tool.function
    entry = inference_pb2.Tool(
        name=function.name, description=function.description, strict=function.strict
    )
    if function.parameters is not None:
        entry.parameters = json.dumps(function.parameters, ensure_ascii=False)
    return entry


def _tool_choice(value: str | schemas.NamedToolChoice) -> inference_pb2.ToolChoice:
    if isinstance(value, str):
        return inference_pb2.ToolChoice(mode=TOOL_CHOICES[value])
    return inference_pb2.ToolChoice(function=value.function.name)


def chat_request(body: Any, request_id: str = "") -> inference_pb2.ChatRequest:
    """The processor's request for `body`: a ChatCompletionRequest, or the JSON object
    of one."""
    body = bodies.typed(body, schemas.ChatCompletionRequest)
    request = inference_pb2.ChatRequest(
        request_id=request_id, model=body.model, sampling=sampling(body)
    )
    for i, message in enumerate(body.messages):
        param = f"messages[{i}]"
        entry = inference_pb2.ChatMessage(
            role=ROLES[message.role], content=_content(message.content, f"{param}.content")
        )
        if message.tool_calls is not None:
            entry.tool_calls.extend(_tool_call(call) for call in message.tool_calls)
        if message.tool_call_id is not None:
            entry.tool_call_id = message.tool_call_id
        request.messages.append(entry)
    if body.tools is not None:
        request.tools.extend(_tool(tool) for tool in body.tools)
    if body.tool_choice is not None:
        request.tool_choice.CopyFrom(_tool_choice(body.tool_choice))
    if body.parallel_tool_calls is not None:
        request.parallel_tool_calls = body.parallel_tool_calls
    if body.logprobs:
        request.sampling.logprobs = body.top_logprobs or 0
    elif body.top_logprobs:
        raise invalid("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
    return request


def _reasoning(text: str | None) -> dict[str, Any]:
    # `reasoning` as vLLM's server names it, and `reasoning_content` as DeepSeek's API,
    # Dynamo and earlier vLLM servers did, for clients written against either.
    return {"reasoning": text, "reasoning_content": text}


def chat_message(parsed: inference_pb2.ParsedChoice) -> dict[str, Any]:
    """A whole chat choice's `message`, where the server parses reasoning or tool calls."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": parsed.content if parsed.HasField("content") else None,
    }
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in parsed.tool_calls
        ]  # fmt: skip
    return {**message, **_reasoning(parsed.reasoning if parsed.HasField("reasoning") else None)}


def chat_delta(reply: inference_pb2.ChatResponse) -> dict[str, Any]:
    """A chat chunk's `delta`, as vLLM's server streams content, reasoning and calls."""
    delta: dict[str, Any] = _reasoning(reply.reasoning) if reply.reasoning else {}
    if reply.tool_calls:
        delta["content"] = reply.text or None
        delta["tool_calls"] = [_tool_call_delta(call) for call in reply.tool_calls]
    elif reply.text or not reply.reasoning:
        delta["content"] = reply.text
    return delta


def _tool_call_delta(call: inference_pb2.ToolCallDelta) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": call.index}
    if call.id:
        entry.update(id=call.id, type="function")
    function = {}
    if call.name:
        function["name"] = call.name
    if call.arguments:
        function["arguments"] = call.arguments
    if function:
        entry["function"] = function
    return entry


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(
    positions: list[common_pb2.PositionLogprobs], top_logprobs: int
) -> dict[str, Any]:
    """A chat choice's `logprobs`, as vLLM's server writes it."""
    return {
        "content": [
            {
                "token": p.token.token,
                "logprob": logprob(p.token.logprob),
                "bytes": _utf8(p.token.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": logprob(t.logprob), "bytes": _utf8(t.token)}
                    for t in position_tokens(p)[:top_logprobs]
                ],
            }
            for p in positions
        ]
    }


class ChatAnswer:
    """One chat request's answer: an SSE chunk per message (`chunk`), or the whole body
    from each choice's messages (`final`)."""

    def __init__(self, request_id: str, params: common_pb2.SamplingParams) -> None:
        self.request_id = request_id
        self.created = int(time.time())
        # Top logprobs per position, where logprobs are asked for.
        self.top_logprobs = params.logprobs if params.HasField("logprobs") else None
        self._plain = PlainChunks(request_id, "chat.completion.chunk", self.created,
                                  b'"delta":{"content":', b"}")  # fmt: skip

    def _logprobs(self, positions: list) -> dict | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(positions, self.top_logprobs)

    def _head(self, reply: inference_pb2.ChatResponse, kind: str) -> dict:
        return {
            "id": self.request_id,
            "object": kind,
            "created": self.created,
            "model": reply.model,
        }

    def chunk(self, reply: inference_pb2.ChatResponse, first: bool) -> dict:
        delta = chat_delta(reply)
        if first:
            delta = {"role": "assistant", **delta}
        choice = {
            "index": reply.index,
            "delta": delta,
            "logprobs": self._logprobs(list(reply.logprobs)),
            "finish_reason": finish_reason(reply.finish_reason),
        }
        return {**self._head(reply, "chat.completion.chunk"), "choices": [choice]}

    def plain(self, reply: inference_pb2.ChatResponse, first: bool) -> bytes | None:
        if first or reply.reasoning or reply.tool_calls or self.top_logprobs is not None:
            return None
        return self._plain.of(reply)

    def _choice(self, index: int, replies: list[inference_pb2.ChatResponse]) -> dict:
        end = replies[-1]
        if end.HasField("parsed"):
            message = chat_message(end.parsed)
            reason = end.parsed.finish_reason
        else:
            text = "".join(reply.text for reply in replies)
            message, reason = {"role": "assistant", "content": text}, end.finish_reason
        return {
            "index": index,
            "message": message,
            "logprobs": self._logprobs([p for r in replies for p in r.logprobs]),
            "finish_reason": finish_reason(reason),
        }

    def final(self, choices: dict[int, list], last: inference_pb2.ChatResponse) -> dict:
        return {
            **self._head(last, "chat.completion"),
            "choices": [self._choice(index, replies) for index, replies in choices.items()],
            "usage": usage(last.usage),
        }


@router.post("/v1/chat/completions", openapi_extra=bodies.openapi(schemas.ChatCompletionRequest))
async def chat(request: Request) -> Response:
    body = bodies.decode(await request.body(), schemas.ChatCompletionRequest)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    message = chat_request(body, request_id)
    processor: ProcessorClient = request.app.state.processor
    answer = ChatAnswer(request_id, message.sampling)
    return await respond(request, body, answer, lambda: processor.chat(message))
