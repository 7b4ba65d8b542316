"""A Messages request as the chat request the chat endpoint makes, as vLLM's server converts
it (`vllm.entrypoints.anthropic.serving`): the system prompt first, each message's blocks as
chat content, `tool_use` blocks as the assistant's tool calls, `tool_result` blocks as tool
messages (and their images as a user message after them), Anthropic's tools and tool
choice as OpenAI's."""

from __future__ import annotations

import json
from typing import Any

from prism.gateway import bodies
from prism.gateway.anthropic import schemas as an
from prism.gateway.openai import schemas as oa
from prism.rpc.errors import invalid

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def _url(source: an.Base64Source | an.UrlSource) -> str:
    if isinstance(source, an.UrlSource):
        return source.url
    return f"data:{source.media_type};base64,{source.data}"


def _image(block: an.ImageBlock) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": _url(block.source)}}


def _tool_result(block: an.ToolResultBlock) -> list[dict[str, Any]]:
    """A tool's result as a tool message, and its images, if any, as a user message."""
    content = block.content
    texts = [content] if isinstance(content, str) else []
    images = []
    for part in content if isinstance(content, list) else []:
        if isinstance(part, an.TextBlock):
            texts.append(part.text)
        else:
            images.append(_image(part))
    messages = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": "\n".join(texts)}]
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def _message(message: an.Message) -> list[dict[str, Any]]:
    """The chat messages of one Messages message: tool results first, then its own."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    before: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, an.TextBlock) and block.text:
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, an.ImageBlock):
            parts.append(_image(block))
        elif isinstance(block, an.ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})  # fmt: skip
        elif isinstance(block, an.ToolResultBlock):
            if message.role == "user":
                before.extend(_tool_result(block))
            else:
                parts.append({"type": "text", "text": f"Tool result: {block.content or ''}"})
        # Thinking blocks: the chat contract carries no reasoning in a message, and the
        # chat templates that render it drop it from earlier turns: left out.
    chat: dict[str, Any] = {"role": message.role}
    if len(parts) == 1 and parts[0]["type"] == "text":
        chat["content"] = parts[0]["text"]
    elif parts:
        chat["content"] = parts
    if calls:
        chat["tool_calls"] = calls
    if message.role == "user" and "content" not in chat:
        return before
    return [*before, chat]


def _tools(request: an.MessagesRequest) -> dict[str, Any]:
    if not request.tools:
        return {}
    tools = [{"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": {"type": "object", **tool.input_schema}, "strict": tool.strict,
    }} for tool in request.tools]  # fmt: skip
    fields: dict[str, Any] = {"tools": tools, "tool_choice": "auto"}
    choice = request.tool_choice
    if choice is not None and choice.type == "tool" and not choice.name:
        raise invalid("tool_choice.name is required when type is 'tool'", "tool_choice.name")
    if choice is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        fields["tool_choice"] = _CHOICES.get(choice.type) or {
            "type": "function", "function": {"name": choice.name or ""}}  # fmt: skip
    return fields


def chat_body(request: an.MessagesRequest) -> oa.ChatCompletionRequest:
    """The chat request for `request` (checked, as the chat endpoint checks its own)."""
    messages: list[dict[str, Any]] = []
    system = request.system
    if isinstance(system, list):
        system = "".join(block.text for block in system)
    if system:
        messages.append({"role": "system", "content": system})
    for message in request.messages:
        messages.extend(_message(message))
    sampling = {"temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "stop": request.stop_sequences}  # fmt: skip
    body = {"model": request.model, "messages": messages, "max_tokens": request.max_tokens,
            "stream": request.stream, **sampling, **_tools(request)}  # fmt: skip
    output = request.output_config
    if output is not None and output.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "json_schema", "schema": output.format.schema}}  # fmt: skip
    return bodies.typed(body, oa.ChatCompletionRequest)
