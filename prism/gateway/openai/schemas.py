"""The OpenAI request bodies as typed models: decoded and checked in one pass by msgspec
(chosen by measurement over pydantic and the hand-written checks, bench/notes/scale.md),
described in /openapi.json, and refused as OpenAI's error body naming the field as sent.

What a type cannot say (one field given only with another, token ids as dict keys) the
endpoints check after decoding."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from prism.rpc.errors import PrismError, invalid

T = TypeVar("T", bound=msgspec.Struct)

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


class _Object(msgspec.Struct, omit_defaults=True):
    """A JSON object whose unknown keys are ignored (as OpenAI's SDKs may add some)."""


class _Body(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A request body: an unknown parameter is refused by name."""


# Structured output: OpenAI's `response_format` and vLLM's `structured_outputs`.
class JsonSchemaSpec(_Object, kw_only=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(_Object, tag="text", tag_field="type", kw_only=True):
    pass


class JsonObjectFormat(_Object, tag="json_object", tag_field="type", kw_only=True):
    pass


class JsonSchemaFormat(_Object, tag="json_schema", tag_field="type", kw_only=True):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(_Object, kw_only=True):
    """vLLM's form: exactly one of its fields (checked where it is read)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Object, kw_only=True):
    # A usage chunk at the end of the stream.
    include_usage: bool = False
    # Usage so far on every chunk.
    continuous_usage_stats: bool = False


class GenerationFields(_Body, kw_only=True):
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
class MediaUrl(_Object, kw_only=True):
    url: Text
    detail: str | None = None


class TextPart(_Object, tag="text", tag_field="type", kw_only=True):
    text: str


class ImageUrlPart(_Object, tag="image_url", tag_field="type", kw_only=True):
    image_url: Text | MediaUrl


class VideoUrlPart(_Object, tag="video_url", tag_field="type", kw_only=True):
    video_url: Text | MediaUrl


class AudioUrlPart(_Object, tag="audio_url", tag_field="type", kw_only=True):
    audio_url: Text | MediaUrl


class InputAudio(_Object, kw_only=True):
    # Base64 of the file.
    data: str
    format: Literal["wav", "mp3", "flac", "ogg", "m4a", "webm"]


class InputAudioPart(_Object, tag="input_audio", tag_field="type", kw_only=True):
    input_audio: InputAudio


class ImageEmbeds(_Object, kw_only=True):
    # Base64 of a safetensors file.
    image_embeds: Text
    # Qwen2-VL's (t, h, w), or a batch of one of them.
    image_grid_thw: list[Positive | list[Positive]] | None = None


class ImageEmbedsPart(_Object, tag="image_embeds", tag_field="type", kw_only=True):
    image_embeds: Text | ImageEmbeds


ContentPart = (
    TextPart | ImageUrlPart | VideoUrlPart | AudioUrlPart | InputAudioPart | ImageEmbedsPart
)


class FunctionCall(_Object, kw_only=True):
    name: str
    # JSON text (an object is taken and written as such).
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Object, kw_only=True):
    function: FunctionCall
    type: Literal["function"] = "function"
    id: str | None = None


class ChatMessage(_Object, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(_Object, kw_only=True):
    name: Text
    description: str | None = None
    # A JSON schema.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Object, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(_Object, kw_only=True):
    name: Text


class NamedToolChoice(_Object, kw_only=True):
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


class ResponsesJsonSchema(_Object, tag="json_schema", tag_field="type", kw_only=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesText(_Object, kw_only=True):
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


class LoadLoraAdapterRequest(_Object, kw_only=True):
    """POST /v1/load_lora_adapter."""

    lora_name: Text
    lora_path: Text


class UnloadLoraAdapterRequest(_Object, kw_only=True):
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
_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in BODIES.values()}
_REF = "#/components/schemas/{name}"


def body(path: str) -> dict[str, Any]:
    """The OpenAPI operation's request body for `path`'s endpoint (FastAPI's
    `openapi_extra`): a reference to its model's schema, which `components` holds."""
    name = BODIES[path].__name__
    schema = {"$ref": _REF.format(name=name)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def components() -> dict[str, Any]:
    """The JSON schema of every request body and of the models they hold."""
    _, schemas = msgspec.json.schema_components(BODIES.values(), ref_template=_REF)
    return schemas


def decode(data: bytes, kind: type[T]) -> T:
    """The request body `data` as a `kind` (one of BODIES), or PrismError naming the
    field at fault."""
    try:
        return _DECODERS[kind].decode(data)
    except msgspec.ValidationError as exc:
        if _UNKNOWN.match(str(exc)):
            # Rare: a null is "not given" for any key, known or not, as before typing.
            return typed(msgspec.json.decode(data), kind)
        raise refusal(exc) from None
    except msgspec.DecodeError as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None


def typed(body: Any, kind: type[T], strict: bool = True) -> T:
    """`body` (a decoded JSON value, or already a `kind`) as a `kind`; not `strict`, a
    number or boolean may come as a string."""
    if isinstance(body, kind):
        return body
    if isinstance(body, dict):
        body = {key: value for key, value in body.items() if value is not None}
    try:
        return msgspec.convert(body, kind, strict=strict)
    except msgspec.ValidationError as exc:
        raise refusal(exc) from None


_AT = re.compile(r"^(?P<detail>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`")


def refusal(exc: msgspec.ValidationError) -> PrismError:
    """msgspec's error as OpenAI's: "`detail` - at `$.a[0].b`" names `a[0].b`; a missing
    field names itself; a bad item of a list of numbers or strings names its list."""
    match = _AT.match(str(exc))
    assert match is not None
    detail, path = match["detail"], (match["path"] or "").lstrip(".")
    unknown, missing = _UNKNOWN.match(detail), _MISSING.match(detail)
    if unknown:
        param = ".".join(p for p in (path, unknown["name"]) if p)
        return invalid(f"unsupported parameter '{param}'", param)
    if missing:
        param = ".".join(p for p in (path, missing["name"]) if p)
        return invalid(f"'{param}' is required", param)
    if not path:
        return invalid("request body must be a JSON object")
    if not detail.startswith("Expected `object`"):
        path = re.sub(r"\[\d+\]$", "", path)
    return invalid(f"'{path}': {detail}", path)
