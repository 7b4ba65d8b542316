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

from prism.gateway.client import ProcessorClient
from prism.gateway.openai.protocol import (
    MAX_LOGPROBS,
    bool_field,
    finish_reason,
    int_field,
    is_int,
    json_body,
    logprob,
    model_field,
    position_tokens,
    reject_unknown,
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
# OpenAI's URL parts: the `ContentPart` field each fills and the message it fills it with.
# (The media registry is the processor's: its checks decode with vLLM, which the front
# never imports.)
URL_PARTS = {
    "image_url": ("image", common_pb2.Image),
    "video_url": ("video", common_pb2.Video),
    "audio_url": ("audio", common_pb2.Audio),
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


def _url(part: dict, kind: str, param: str) -> str:
    """The URL of an `image_url` or `video_url` part: {"url": ...}, or the string itself."""
    url = part.get(kind)
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{kind} part needs a 'url' string", f"{param}.{kind}")
    return url


def _input_audio_part(part: dict, param: str) -> inference_pb2.ContentPart:
    """OpenAI's form: {"input_audio": {"data": base64 of the file, "format": "wav"|...}}."""
    param = f"{param}.input_audio"
    value = part.get("input_audio")
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise invalid("input_audio part needs {'data': base64, 'format': ...}", param)
    fmt = value.get("format")
    if fmt not in AUDIO_FORMATS:
        raise invalid(f"input_audio format must be one of {', '.join(AUDIO_FORMATS)}", param)
    try:
        data = base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid("input_audio data is not valid base64", f"{param}.data") from None
    audio = common_pb2.Audio(data=data, mime_type=AUDIO_FORMATS[fmt])
    return inference_pb2.ContentPart(audio=audio)


def _image_embeds_part(part: dict, param: str) -> inference_pb2.ContentPart:
    """vLLM's form: base64 (here: of a safetensors file, never a pickle), or for the
    Qwen2-VL family {"image_embeds": base64, "image_grid_thw": [t, h, w]}."""
    param = f"{param}.image_embeds"
    value, grid = part.get("image_embeds"), None
    if isinstance(value, dict):
        value, grid = value.get("image_embeds"), value.get("image_grid_thw")
    if not isinstance(value, str) or not value:
        raise invalid("image_embeds part needs base64-encoded safetensors", param)
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("image_embeds is not valid base64", param) from None
    embedding = embeds.from_safetensors(data, param)
    if grid is not None:
        # vLLM takes (3,) per image; (1, 3) is the same grid as a batch of one.
        if isinstance(grid, list) and len(grid) == 1 and isinstance(grid[0], list):
            grid = grid[0]
        if not isinstance(grid, list) or not all(is_int(v) and v > 0 for v in grid):
            raise invalid("image_grid_thw must be a list of positive integers", param)
        embedding.image_grid_thw.extend(grid)
    return inference_pb2.ContentPart(image_embedding=embedding)


def _content(content: Any, param: str) -> list[inference_pb2.ContentPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [inference_pb2.ContentPart(text=content)]
    if not isinstance(content, list):
        raise invalid("'content' must be a string or a list of parts", param)
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise invalid("content part must be an object", where)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise invalid("text part needs a 'text' string", f"{where}.text")
            parts.append(inference_pb2.ContentPart(text=text))
        elif kind in URL_PARTS:
            field, message = URL_PARTS[kind]
            media = message(url=_url(part, kind, where))
            parts.append(inference_pb2.ContentPart(**{field: media}))
        elif kind == "image_embeds":
            parts.append(_image_embeds_part(part, where))
        elif kind == "input_audio":
            parts.append(_input_audio_part(part, where))
        else:
            raise invalid(
                f"unsupported content part type {kind!r}: use 'text', 'image_url', "
                "'video_url', 'audio_url', 'input_audio' or 'image_embeds'",
                f"{where}.type",
            )
    return parts


def _tool_calls(calls: Any, param: str) -> list[inference_pb2.ToolCall]:
    """An assistant message's `tool_calls`: arguments as JSON text (an object is written
    as such)."""
    if not isinstance(calls, list):
        raise invalid("'tool_calls' must be a list", param)
    result = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise invalid("a tool call must be of type 'function' with a 'function'", where)
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str):
            raise invalid("a tool call's function needs a 'name' string", f"{where}.function")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        elif arguments is not None and not isinstance(arguments, str):
            raise invalid("'arguments' must be a JSON string", f"{where}.function")
        call_id = call.get("id")
        result.append(inference_pb2.ToolCall(
            id=call_id if isinstance(call_id, str) else "", name=name, arguments=arguments or ""
        ))  # fmt: skip
    return result


def _tools(tools: Any) -> list[inference_pb2.Tool]:
    if not isinstance(tools, list) or not tools:
        # As vLLM and OpenAI: an empty list is an error, not "no tools".
        raise invalid("'tools' must be a non-empty list of function tools", "tools")
    result = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise invalid("a tool must be of type 'function' with a 'function' object", where)
        name, description = function.get("name"), function.get("description")
        parameters, strict = function.get("parameters"), function.get("strict")
        if not isinstance(name, str) or not name:
            raise invalid("a function tool needs a 'name' string", f"{where}.function.name")
        if description is not None and not isinstance(description, str):
            raise invalid("'description' must be a string", f"{where}.function.description")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid("'parameters' must be a JSON schema", f"{where}.function.parameters")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("'strict' must be a boolean", f"{where}.function.strict")
        entry = inference_pb2.Tool(name=name, description=description, strict=strict)
        if parameters is not None:
            entry.parameters = json.dumps(parameters, ensure_ascii=False)
        result.append(entry)
    return result


def _tool_choice(value: Any) -> inference_pb2.ToolChoice:
    if isinstance(value, str) and value in TOOL_CHOICES:
        return inference_pb2.ToolChoice(mode=TOOL_CHOICES[value])
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return inference_pb2.ToolChoice(function=name)


def chat_request(body: Any, request_id: str = "") -> inference_pb2.ChatRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    request = inference_pb2.ChatRequest(
        request_id=request_id, model=model_field(body), sampling=sampling(body)
    )
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid("message must be an object", param)
        role = ROLES.get(message.get("role"))
        if role is None:
            raise invalid(
                f"unsupported role {message.get('role')!r}: use system, developer, user, "
                "assistant or tool",
                f"{param}.role",
            )
        entry = inference_pb2.ChatMessage(
            role=role, content=_content(message.get("content"), f"{param}.content")
        )
        if message.get("tool_calls") is not None:
            entry.tool_calls.extend(_tool_calls(message["tool_calls"], f"{param}.tool_calls"))
        call_id = message.get("tool_call_id")
        if call_id is not None:
            if not isinstance(call_id, str):
                raise invalid("'tool_call_id' must be a string", f"{param}.tool_call_id")
            entry.tool_call_id = call_id
        request.messages.append(entry)
    if "tools" in body and body["tools"] is not None:
        request.tools.extend(_tools(body["tools"]))
    if body.get("tool_choice") is not None:
        request.tool_choice.CopyFrom(_tool_choice(body["tool_choice"]))
    if body.get("parallel_tool_calls") is not None:
        request.parallel_tool_calls = bool_field(body, "parallel_tool_calls")
    reject_unknown(body, {"model", "messages", "logprobs", "top_logprobs", "tools",
                          "tool_choice", "parallel_tool_calls"})  # fmt: skip
    top = int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
    if bool_field(body, "logprobs"):
        request.sampling.logprobs = top or 0
    elif top:
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


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    body = await json_body(request)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    message = chat_request(body, request_id)
    processor: ProcessorClient = request.app.state.processor
    answer = ChatAnswer(request_id, message.sampling)
    return await respond(request, body, answer, lambda: processor.chat(message))
