"""OpenAI REST bodies to and from the processor's protobuf messages (pure functions)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import math
from typing import Any

from prism import embeds
from prism.rpc import PrismError, invalid
from prism.v1 import common_pb2, inference_pb2

ROLES = {
    "system": inference_pb2.ROLE_SYSTEM,
    "user": inference_pb2.ROLE_USER,
    "assistant": inference_pb2.ROLE_ASSISTANT,
    "developer": inference_pb2.ROLE_DEVELOPER,
    "tool": inference_pb2.ROLE_TOOL,
}
FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
TOOL_CHOICES = {
    "none": inference_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": inference_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": inference_pb2.TOOL_CHOICE_MODE_REQUIRED,
}
# Accepted and ignored because they change nothing here (OpenAI clients send them).
_IGNORED = {"user", "stream", "stream_options", "metadata", "store", "service_tier"}
# Ranges as vLLM's OpenAI server checks them.
FLOAT_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, math.inf),
}
SAMPLING_KEYS = {
    *FLOAT_RANGES,
    "top_k",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "include_stop_str_in_output",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "skip_special_tokens",
}
# Most top logprobs a request may ask for (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, low: int, high: int = 2**31 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or not low <= value <= high:
        raise invalid(f"'{name}' must be an integer from {low} to {high}, got {value!r}", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def sampling(body: dict) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    for name, (low, high) in FLOAT_RANGES.items():
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise invalid(f"'{name}' must be a number, got {value!r}", name)
        if not low <= value <= high or math.isnan(value):
            raise invalid(f"'{name}' must be from {low} to {high}, got {value!r}", name)
        setattr(params, name, float(value))
    top_k = _int(body, "top_k", -1)
    if top_k is not None:
        params.top_k = top_k
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    params.min_tokens = _int(body, "min_tokens", 0) or 0
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    if seed is not None:
        params.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise invalid("'stop' must be a non-empty string or a list of them", "stop")
        params.stop.extend(stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
            raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        params.stop_token_ids.extend(stop_ids)
    params.ignore_eos = _bool(body, "ignore_eos")
    params.include_stop_str_in_output = _bool(body, "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = _bool(body, "skip_special_tokens")
    params.n = _int(body, "n", 1, 128) or 1
    bias = body.get("logit_bias")
    if bias is not None:
        params.logit_bias.update(_logit_bias(bias))
    structured = _structured_output(body)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    return params


def _logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias}, each bias clamped to [-100, 100] as vLLM does."""
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must map token ids to numbers", "logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if token < 0 or isinstance(number, bool) or not isinstance(number, int | float):
            raise invalid(f"'logit_bias' has a bad entry {key!r}: {number!r}", "logit_bias")
        bias[token] = min(100.0, max(-100.0, float(number)))
    return bias


def _structured_output(body: dict) -> common_pb2.StructuredOutput | None:
    """`response_format` (OpenAI), or vLLM's own `structured_outputs`; the first wins
    where both are given, as in vLLM's server."""
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise invalid("'response_format' must be an object", "response_format")
        kind = response_format.get("type")
        if kind == "json_object":
            return common_pb2.StructuredOutput(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise invalid(
                    "response_format of type 'json_schema' needs json_schema.schema, an object",
                    "response_format",
                )
            return common_pb2.StructuredOutput(json_schema=json.dumps(schema))
        if kind != "text":
            raise invalid(
                f"unsupported response_format type {kind!r}: use 'text', 'json_object' or "
                "'json_schema'",
                "response_format",
            )
    spec = body.get("structured_outputs")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise invalid("'structured_outputs' must be an object", "structured_outputs")
    given = {k: v for k, v in spec.items() if v is not None}
    kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if k in given]
    if len(kinds) != 1 or len(given) != 1:
        raise invalid(
            "'structured_outputs' takes exactly one of json, regex, choice, grammar or json_object",
            "structured_outputs",
        )
    (kind,) = kinds
    value = given[kind]
    if kind == "json":
        if isinstance(value, str):
            value = json_text(value, "structured_outputs.json")
        if not isinstance(value, dict):
            raise invalid("structured_outputs.json must be a JSON schema", "structured_outputs")
        return common_pb2.StructuredOutput(json_schema=json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise invalid("structured_outputs.json_object must be true", "structured_outputs")
        return common_pb2.StructuredOutput(json_object=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(
                "structured_outputs.choice must be a non-empty list of strings",
                "structured_outputs",
            )
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=value))
    if not isinstance(value, str):
        raise invalid(f"structured_outputs.{kind} must be a string", "structured_outputs")
    return common_pb2.StructuredOutput(**{kind: value})


def json_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"{param} is not valid JSON: {exc}", param.split(".")[0]) from None


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model")
    return model


def _url(part: dict, kind: str, param: str) -> str:
    """The URL of an `image_url` or `video_url` part: {"url": ...}, or the string itself."""
    url = part.get(kind)
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{kind} part needs a 'url' string", f"{param}.{kind}")
    return url


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
        if not isinstance(grid, list) or not all(_is_int(v) and v > 0 for v in grid):
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
        elif kind == "image_url":
            image = common_pb2.Image(url=_url(part, "image_url", where))
            parts.append(inference_pb2.ContentPart(image=image))
        elif kind == "video_url":
            video = common_pb2.Video(url=_url(part, "video_url", where))
            parts.append(inference_pb2.ContentPart(video=video))
        elif kind == "image_embeds":
            parts.append(_image_embeds_part(part, where))
        else:
            raise invalid(
                f"unsupported content part type {kind!r}: use 'text', 'image_url', "
                "'video_url' or 'image_embeds'",
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
        request_id=request_id, model=_model(body), sampling=sampling(body)
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
        request.parallel_tool_calls = _bool(body, "parallel_tool_calls")
    _reject_unknown(body, {"model", "messages", "logprobs", "top_logprobs", "tools",
                           "tool_choice", "parallel_tool_calls"})  # fmt: skip
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if _bool(body, "logprobs"):
        request.sampling.logprobs = top or 0
    elif top:
        raise invalid("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
    return request


def completion_request(body: Any, request_id: str = "") -> inference_pb2.CompleteRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    request = inference_pb2.CompleteRequest(
        request_id=request_id, model=_model(body), sampling=sampling(body)
    )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise invalid(
            "'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt"
        )
    _reject_unknown(body, {"model", "prompt", "echo", "logprobs", "prompt_logprobs", "suffix"})
    if body.get("suffix"):
        raise invalid("'suffix' is not supported", "suffix")
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    if logprobs is not None:
        request.sampling.logprobs = logprobs
    prompt_logprobs = _int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    if prompt_logprobs is not None:
        if prompt_logprobs and wants_stream(body):
            raise invalid("'prompt_logprobs' are not available when streaming", "prompt_logprobs")
        request.sampling.prompt_logprobs = prompt_logprobs
    request.echo = _bool(body, "echo")
    return request


def _reject_unknown(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if value is not None and key not in known | SAMPLING_KEYS | _IGNORED:
            raise invalid(f"unsupported parameter '{key}'", key)


def wants_stream(body: dict) -> bool:
    return _bool(body, "stream")


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    # A usage chunk at the end of the stream.
    include_usage: bool = False
    # Usage so far on every chunk.
    continuous_usage_stats: bool = False


def stream_options(body: dict) -> StreamOptions:
    options = body.get("stream_options")
    if options is None:
        return StreamOptions()
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options")
    return StreamOptions(_bool(options, "include_usage"), _bool(options, "continuous_usage_stats"))


def usage(value: common_pb2.Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": value.prompt_tokens,
        "completion_tokens": value.completion_tokens,
        "total_tokens": value.total_tokens,
        "prompt_tokens_details": {"cached_tokens": value.cached_tokens},
    }
    if value.reasoning_tokens:
        body["completion_tokens_details"] = {"reasoning_tokens": value.reasoning_tokens}
    return body


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


def finish_reason(value: int) -> str | None:
    return FINISH_REASONS.get(value)


def error_body(error: PrismError, request_id: str = "") -> dict[str, Any]:
    """OpenAI's error body; a server error's message ends with the request's id, which
    finds its story in every stage's logs and traces."""
    status = error.http_status
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    elif status == 429:
        kind = "rate_limit_error"
    message = error.message
    if status >= 500 and request_id:
        message = f"{message} (request {request_id})"
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": error.param,
            "code": error.reason_name.lower(),
        }
    }


def as_sent(error: PrismError, body: dict) -> PrismError:
    """`error`, naming the parameter as the client sent it: `max_completion_tokens`
    travels to the processor as `max_tokens`, `response_format` and `structured_outputs`
    as `structured_output`."""
    if error.param == "max_tokens" and body.get("max_completion_tokens") is not None:
        message = error.message.replace("max_tokens", "max_completion_tokens")
        return dataclasses.replace(error, message=message, param="max_completion_tokens")
    if error.param == "structured_output":
        given = body.get("response_format") is not None
        sent = "response_format" if given else "structured_outputs"
        return dataclasses.replace(error, param=sent)
    return error


def _logprob(value: float) -> float:
    # OpenAI's stand-in for minus infinity, as vLLM's server sends it.
    return max(value, -9999.0)


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def _entries(position: common_pb2.PositionLogprobs) -> list[common_pb2.TokenLogprob]:
    """The position's token, then the top tokens not listed yet: the order in which vLLM
    lists a position's tokens."""
    entries = {position.token.token_id: position.token}
    for token in position.top:
        entries.setdefault(token.token_id, token)
    return list(entries.values())


def chat_logprobs(
    positions: list[common_pb2.PositionLogprobs], top_logprobs: int
) -> dict[str, Any]:
    """A chat choice's `logprobs`, as vLLM's server writes it."""
    return {
        "content": [
            {
                "token": p.token.token,
                "logprob": _logprob(p.token.logprob),
                "bytes": _utf8(p.token.token),
                "top_logprobs": [
                    {"token": t.token, "logprob": _logprob(t.logprob), "bytes": _utf8(t.token)}
                    for t in _entries(p)[:top_logprobs]
                ],
            }
            for p in positions
        ]
    }


def completion_logprobs(
    positions: list[common_pb2.PositionLogprobs], logprobs: int, text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's `logprobs`, as vLLM's server writes it: `text_offset` is
    where the first token starts; each next one starts where the one before ends."""
    body: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                             "top_logprobs": []}  # fmt: skip
    for p in positions:
        body["text_offset"].append(text_offset)
        text_offset += len(p.token.token)
        body["tokens"].append(p.token.token)
        if not p.token.rank:
            # The prompt's first token, echoed: nothing came before it.
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(_logprob(p.token.logprob))
        # OpenAI's completions list the asked number and the token itself.
        entries = _entries(p)[: logprobs + 1]
        body["top_logprobs"].append({t.token: _logprob(t.logprob) for t in entries})
    return body


def prompt_logprobs(positions: list[common_pb2.PositionLogprobs]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` extension: per prompt token, its tokens by id."""
    return [
        {
            str(t.token_id): {
                "logprob": _logprob(t.logprob),
                "rank": t.rank,
                "decoded_token": t.token,
            }
            for t in _entries(p)
        }
        if p.token.rank
        else None
        for p in positions
    ]
