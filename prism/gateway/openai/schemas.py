"""The OpenAI request bodies as typed models (decoded by prism.gateway.bodies).

What a type cannot say (one field given only with another, token ids as dict keys) the
endpoints check after decoding."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from prism.gateway.bodies import Body, Object

INT32 = 2**31 - 1
# Most top logprobs a request may ask for (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20

Text = Annotated[str, Meta(min_length=1)]
Positive = Annotated[int, Meta(ge=1, le=INT32)]
Count = Annotated[int, Meta(ge=0, le=INT32)]
Share = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TokenId = Annotated[int, Meta(ge=0)]


# Structured output: OpenAI's `response_format` and vLLM's `structured_outputs`.
class JsonSchemaSpec(Object, kw_only=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(Object, tag="text", tag_field="type", kw_only=True):
    pass


class JsonObjectFormat(Object, tag="json_object", tag_field="type", kw_only=True):
    pass


class JsonSchemaFormat(Object, tag="json_schema", tag_field="type", kw_only=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(Object, kw_only=True):
    """vLLM's form: exactly one of its fields (checked where it is read)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(Object, kw_only=True):
    # A usage chunk at the end of the stream.
    include_usage: bool = False
    # Usage so far on every chunk.
    continuous_usage_stats: bool = False


class GenerationFields(Body, kw_only=True):
    """The sampling fields every generation endpoint takes, with the ranges vLLM's OpenAI
    server takes, and those accepted and not acted on (they change nothing here)."""

    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Share | None = None
    min_p: Share | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=0.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32)] | None = None
    min_tokens: Count | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Token id (as a string) -> bias, clamped to [-100, 100] as vLLM does.
    logit_bias: dict[str, float] | None = None
    stream: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None


class Sampling(GenerationFields, kw_only=True):
    """What chat and completions add to `GenerationFields`."""

    max_tokens: Positive | None = None
    max_completion_tokens: Positive | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = None
    stream_interval: Positive | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    stream_options: StreamOptions | None = None


# Chat content parts, by their `type`.
class MediaUrl(Object, kw_only=True):
    url: Text
    detail: str | None = None


class TextPart(Object, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageUrlPart(Object, tag="image_url", tag_field="type", kw_only=True):
    image_url: Text | MediaUrl


class VideoUrlPart(Object, tag="video_url", tag_field="type", kw_only=True):
    video_url: Text | MediaUrl


class AudioUrlPart(Object, tag="audio_url", tag_field="type", kw_only=True):
    audio_url: Text | MediaUrl


class InputAudio(Object, kw_only=True):
    # Base64 of the file.
    data: str
    format: Literal["wav", "mp3", "flac", "ogg", "m4a", "webm"]


class InputAudioPart(Object, tag="input_audio", tag_field="type", kw_only=True):
    input_audio: InputAudio


class ImageEmbeds(Object, kw_only=True):
    # Base64 of a safetensors file.
    image_embeds: Text
    # Qwen2-VL's (t, h, w), or a batch of one of them.
    image_grid_thw: list[Positive | list[Positive]] | None = None


class ImageEmbedsPart(Object, tag="image_embeds", tag_field="type", kw_only=True):
    image_embeds: Text | ImageEmbeds


ContentPart = (
    TextPart | ImageUrlPart | VideoUrlPart | AudioUrlPart | InputAudioPart | ImageEmbedsPart
)


class FunctionCall(Object, kw_only=True):
    name: str
    # JSON text (an object is taken and written as such).
    arguments: str | dict[str, Any] | None = None


class ToolCall(Object, kw_only=True):
    function: FunctionCall
    type: Literal["function"] = "function"
    id: str | None = None


class ChatMessage(Object, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(Object, kw_only=True):
    name: Text
    description: str | None = None
    # A JSON schema.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Object, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(Object, kw_only=True):
    name: Text


class NamedToolChoice(Object, kw_only=True):
    function: FunctionName
    type: Literal["function"] = "function"


class ChatCompletionRequest(Sampling, kw_only=True):
    """POST /v1/chat/completions."""

    model: Text
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    # As vLLM and OpenAI: an empty list is an error, not "no tools".
    tools: Annotated[list[Tool], Meta(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None


class CompletionRequest(Sampling, kw_only=True):
    """POST /v1/completions: one prompt, text or token ids."""

    model: Text
    prompt: str | list[str | TokenId | list[TokenId]]
    echo: bool | None = None
    logprobs: TopLogprobs | None = None
    prompt_logprobs: TopLogprobs | None = None
    suffix: str | None = None


class ResponsesJsonSchema(Object, tag="json_schema", tag_field="type", kw_only=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(Object, kw_only=True):
    format: TextFormat | JsonObjectFormat | ResponsesJsonSchema | None = None


class ResponsesRequest(GenerationFields, kw_only=True):
    """POST /v1/responses. Its input items are read as chat messages
    (prism.gateway.openai.responses.items), which checks them."""

    model: Text
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Positive | None = None
    text: ResponsesText | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None
    top_logprobs: TopLogprobs | None = None
    background: bool | None = None
    # Accepted and not acted on.
    reasoning: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    include_reasoning: bool | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    safety_identifier: str | None = None


class LoadLoraAdapterRequest(Object, kw_only=True):
    """POST /v1/load_lora_adapter."""

    lora_name: Text
    lora_path: Text


class UnloadLoraAdapterRequest(Object, kw_only=True):
    """POST /v1/unload_lora_adapter."""

    lora_name: Text


# What each endpoint's body is decoded as (read by prism.gateway.openapi).
BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
