"""What the OpenAI endpoints share: reading a request's body and its sampling
parameters, and writing usage, finish reasons, logprobs and errors as vLLM's OpenAI server
does. Pure functions, save `json_body`."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from fastapi import Request

from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError, invalid

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
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
    "stream_interval",
}
# Most top logprobs a request may ask for (vLLM's default --max-logprobs).
MAX_LOGPROBS = 20


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(body: dict, name: str, low: int, high: int = 2**31 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or not low <= value <= high:
        raise invalid(f"'{name}' must be an integer from {low} to {high}, got {value!r}", name)
    return value


def bool_field(body: dict, name: str) -> bool:
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
    top_k = int_field(body, "top_k", -1)
    if top_k is not None:
        params.top_k = top_k
    max_tokens = int_field(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = int_field(body, "max_tokens", 1)
    if max_tokens is not None:
        params.max_tokens = max_tokens
    params.min_tokens = int_field(body, "min_tokens", 0) or 0
    seed = int_field(body, "seed", -(2**63), 2**63 - 1)
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
        if not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids):
            raise invalid("'stop_token_ids' must be a list of token ids", "stop_token_ids")
        params.stop_token_ids.extend(stop_ids)
    params.ignore_eos = bool_field(body, "ignore_eos")
    params.include_stop_str_in_output = bool_field(body, "include_stop_str_in_output")
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = bool_field(body, "skip_special_tokens")
    params.n = int_field(body, "n", 1, 128) or 1
    interval = int_field(body, "stream_interval", 1)
    if interval is not None:
        params.stream_interval = interval
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


def model_field(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a string", "model")
    return model


def reject_unknown(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if value is not None and key not in known | SAMPLING_KEYS | _IGNORED:
            raise invalid(f"unsupported parameter '{key}'", key)


def wants_stream(body: dict) -> bool:
    return bool_field(body, "stream")


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
    return StreamOptions(
        bool_field(options, "include_usage"), bool_field(options, "continuous_usage_stats")
    )


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


def logprob(value: float) -> float:
    # OpenAI's stand-in for minus infinity, as vLLM's server sends it.
    return max(value, -9999.0)


def position_tokens(position: common_pb2.PositionLogprobs) -> list[common_pb2.TokenLogprob]:
    """The position's token, then the top tokens not listed yet: the order in which vLLM
    lists a position's tokens."""
    entries = {position.token.token_id: position.token}
    for token in position.top:
        entries.setdefault(token.token_id, token)
    return list(entries.values())


async def json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
