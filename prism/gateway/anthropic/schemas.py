"""Anthropic's Messages request as typed models (msgspec, as the OpenAI bodies are:
prism.gateway.openai.schemas), and its error body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from prism.gateway.bodies import Body, Object
from prism.gateway.openai.schemas import Positive, Share, Text
from prism.rpc.errors import PrismError


class Base64Source(Object, tag="base64", tag_field="type"):
    media_type: str
    data: str


class UrlSource(Object, tag="url", tag_field="type"):
    url: Text


class TextBlock(Object, tag="text", tag_field="type"):
    text: str


class ImageBlock(Object, tag="image", tag_field="type"):
    source: Base64Source | UrlSource


class ToolUseBlock(Object, tag="tool_use", tag_field="type"):
    id: str
    name: Text
    input: dict[str, Any]


class ToolResultBlock(Object, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(Object, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Object, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class Message(Object):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(Object):
    name: Text
    # A JSON schema of the tool's input.
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None


class ToolChoice(Object):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(Object, tag="json_schema", tag_field="type"):
    schema: dict[str, Any]


class OutputConfig(Object):
    format: JsonOutputFormat | None = None
    # Accepted and not acted on.
    effort: str | None = None


class MessagesRequest(Body, kw_only=True):
    """POST /v1/messages."""

    model: Text
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: Positive
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Text] | None = None
    stream: bool | None = None
    temperature: Share | None = None
    top_p: Share | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    # Answers in JSON of a schema (a structured output).
    output_config: OutputConfig | None = None
    # Accepted and not acted on: they change nothing in what is generated here (reasoning,
    # where the mesh parses it, is always answered).
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(Body, kw_only=True):
    """POST /v1/messages/count_tokens: what a Messages request's prompt is made of."""

    model: Text
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None

    def as_message(self) -> MessagesRequest:
        """The Messages request whose prompt this is."""
        fields = {f: getattr(self, f) for f in self.__struct_fields__}
        return MessagesRequest(max_tokens=1, **fields)


# What each endpoint's body is decoded as (read by prism.gateway.openapi).
BODIES: dict[str, type[Struct]] = {
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
}

# Anthropic's error types, by HTTP status.
_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: PrismError, request_id: str = "") -> dict[str, Any]:
    """Anthropic's error body; a server error's message ends with the request's id."""
    status = error.http_status
    message = error.message
    if status >= 500 and request_id:
        message = f"{message} (request {request_id})"
    kind = _ERRORS.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
