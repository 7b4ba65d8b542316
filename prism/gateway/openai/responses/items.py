"""A Responses request (its fields, as ResponsesRequest checked them) as the chat body the
chat endpoint checks: `instructions`, the turns a
`previous_response_id` continues, then the `input` items as chat messages, as vLLM's
server builds them (`construct_input_messages`); the rest of the body as chat's fields.
Every check names the field as the client sent it."""

from __future__ import annotations

import re
from typing import Any

from prism.rpc.errors import PrismError, invalid

ROLES = ("user", "system", "developer", "assistant")
# Chat's own part types, which vLLM's server takes in a Responses message too.
CHAT_PARTS = ("text", "image_url", "video_url", "audio_url", "input_audio", "image_embeds")
# Fields passed to chat as they are (sampling and tools' switches); checked there.
SAME = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids",
        "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
        "include_stop_str_in_output", "parallel_tool_calls")  # fmt: skip
LOGPROBS = "message.output_text.logprobs"


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid("'text' must be a string", f"{where}.text")
    return value


def _part(part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise invalid("a content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _text(part.get("text"), where)}
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise invalid("file ids are not supported: send 'image_url'", f"{where}.file_id")
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise invalid("input_image needs an 'image_url' string", f"{where}.image_url")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind in CHAT_PARTS:
        return part
    raise invalid(
        f"unsupported content part type {kind!r}: use 'input_text', 'input_image', "
        "'input_audio', 'video_url' or 'audio_url'",
        f"{where}.type",
    )


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("'content' must be a string or a list of parts", where)
    return [_part(part, f"{where}[{j}]") for j, part in enumerate(content)]


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string", f"{where}.{name}")
    return value


class Conversation:
    """Chat messages, each with the field of the request it came from (for errors)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.sources: list[str] = []

    def add(self, message: dict[str, Any], source: str) -> None:
        self.messages.append(message)
        self.sources.append(source)

    def _assistant(self) -> dict[str, Any] | None:
        last = self.messages[-1] if self.messages else None
        return last if last is not None and last["role"] == "assistant" else None

    def item(self, item: Any, where: str) -> None:
        if not isinstance(item, dict):
            raise invalid("an input item must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, where)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}  # fmt: skip
            # Calls after an assistant message are that message's, as in vLLM.
            last = self._assistant()
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                self.add({"role": "assistant", "content": None, "tool_calls": [call]}, where)
        elif kind == "function_call_output":
            output = _string(item, "output", where)
            self.add({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                      "content": output}, where)  # fmt: skip
        elif kind == "reasoning":
            # The chat contract carries no reasoning in a message, and the chat templates
            # that render it drop it from earlier turns: left out.
            pass
        else:
            raise invalid(
                f"unsupported input item type {kind!r}: use 'message', 'function_call', "
                "'function_call_output' or 'reasoning'",
                f"{where}.type",
            )

    def _message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise invalid(f"unsupported role {role!r}: use {', '.join(ROLES)}", f"{where}.role")
        content = _content(item.get("content"), f"{where}.content")
        last = self._assistant()
        if role == "assistant" and last is not None and last.get("content") is None:
            last["content"] = content
            return
        self.add({"role": role, "content": content}, where)

    def error(self, error: PrismError) -> PrismError:
        """`error` as the client sent the field: `messages[k]...` becomes the item's path."""
        match = re.match(r"messages\[(\d+)\]", error.param or "")
        if match is None:
            return error
        source = self.sources[int(match.group(1))]
        error.param = source + (error.param or "")[match.end() :]
        error.message = error.message.replace(match.group(0), source)
        return error


def conversation(body: dict[str, Any], previous: list[dict[str, Any]] | None) -> Conversation:
    """The request's messages: instructions as a system message, the stored turns (their
    own instructions left out), then `input`."""
    talk = Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        talk.add({"role": "system", "content": instructions}, "instructions")
    for message in previous or []:
        if message["role"] != "system":
            talk.add(message, "previous_response_id")
    given = body["input"]
    if isinstance(given, str):
        talk.add({"role": "user", "content": given}, "input")
    else:
        for i, item in enumerate(given):
            talk.item(item, f"input[{i}]")
    return talk


def _tool(tool: Any, where: str) -> dict[str, Any]:
    """Responses' flat function tool as chat's nested one."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise invalid(f"unsupported tool type {kind!r}: only 'function' tools", f"{where}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(value: str | dict[str, Any]) -> str | dict[str, Any]:
    """Responses' flat function choice as chat's nested one; the rest as it is (chat
    checks it)."""
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    return value


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` (its type checked by ResponsesRequest) as chat's `response_format`."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if spec["type"] == "json_schema":
        return {"type": "json_schema",
                "json_schema": {"name": spec.get("name"), "schema": spec["schema"]}}  # fmt: skip
    return {"type": spec["type"]}


def _logprobs(body: dict[str, Any]) -> dict[str, Any]:
    include = body.get("include") or []
    for i, entry in enumerate(include):
        if entry != LOGPROBS:
            raise invalid(f"unsupported include {entry!r}: only '{LOGPROBS}'", f"include[{i}]")
    if LOGPROBS not in include:
        return {}
    return {"logprobs": True, "top_logprobs": body.get("top_logprobs") or 0}


def stored(body: dict[str, Any]) -> bool:
    """Whether the response is to be kept (by default it is, as OpenAI's API keeps it)."""
    return body.get("store") is not False


def chat_body(body: dict[str, Any], talk: Conversation) -> dict[str, Any]:
    """The chat request's body for `body` (a ResponsesRequest's fields), whose messages are
    `talk`'s."""
    if body.get("background"):
        raise invalid("background responses are not supported", "background")
    chat: dict[str, Any] = {k: body[k] for k in SAME if body.get(k) is not None}
    chat["messages"] = talk.messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if body.get("tool_choice") is not None and chat.get("tools"):
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat | _logprobs(body)
