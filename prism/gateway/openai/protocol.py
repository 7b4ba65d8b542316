"""What the OpenAI endpoints share: reading a request's body and its sampling
parameters, and writing usage, finish reasons, logprobs and errors as vLLM's OpenAI server
does. Pure functions."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from prism.gateway.openai import schemas
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError, invalid

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty")  # fmt: skip


def sampling(body: schemas.Sampling) -> common_pb2.SamplingParams:
    params = common_pb2.SamplingParams()
    for name in _FLOATS:
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, value)
    if body.top_k is not None:
        params.top_k = body.top_k
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is not None:
        params.max_tokens = max_tokens
    params.min_tokens = body.min_tokens or 0
    if body.seed is not None:
        params.seed = body.seed
    if body.stop is not None:
        params.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids is not None:
        params.stop_token_ids.extend(body.stop_token_ids)
    params.ignore_eos = bool(body.ignore_eos)
    params.include_stop_str_in_output = bool(body.include_stop_str_in_output)
    if body.skip_special_tokens is not None:
        params.skip_special_tokens = body.skip_special_tokens
    params.n = body.n or 1
    if body.stream_interval is not None:
        params.stream_interval = body.stream_interval
    if body.logit_bias is not None:
        params.logit_bias.update(_logit_bias(body.logit_bias))
    structured = _structured_output(body)
    if structured is not None:
        params.structured_output.CopyFrom(structured)
    return params


def _logit_bias(value: dict[str, float]) -> dict[int, float]:
    """OpenAI's {"token id": bias}, each bias clamped to [-100, 100] as vLLM does."""
    bias = {}
    for key, number in value.items():
        token = int(key) if key.isdigit() else -1
        if token < 0:
            raise invalid(f"'logit_bias' has a bad entry {key!r}: {number!r}", "logit_bias")
        bias[token] = min(100.0, max(-100.0, number))
    return bias


def _structured_output(body: schemas.Sampling) -> common_pb2.StructuredOutput | None:
    """`response_format` (OpenAI), or vLLM's own `structured_outputs`; the first wins
    where both are given, as in vLLM's server."""
    response_format = body.response_format
    if isinstance(response_format, schemas.JsonObjectFormat):
        return common_pb2.StructuredOutput(json_object=True)
    if isinstance(response_format, schemas.JsonSchemaFormat):
        schema = json.dumps(response_format.json_schema.schema)
        return common_pb2.StructuredOutput(json_schema=schema)
    spec = body.structured_outputs
    if spec is None:
        return None
    given = {f: v for f in spec.__struct_fields__ if (v := getattr(spec, f)) is not None}
    if len(given) != 1:
        raise invalid(
            "'structured_outputs' takes exactly one of json, regex, choice, grammar or json_object",
            "structured_outputs",
        )
    ((kind, value),) = given.items()
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
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=value))
    return common_pb2.StructuredOutput(**{kind: value})


def json_text(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"{param} is not valid JSON: {exc}", param.split(".")[0]) from None


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


def as_sent(error: PrismError, body: schemas.Sampling) -> PrismError:
    """`error`, naming the parameter as the client sent it: `max_completion_tokens`
    travels to the processor as `max_tokens`, `response_format` and `structured_outputs`
    as `structured_output`."""
    if error.param == "max_tokens" and body.max_completion_tokens is not None:
        message = error.message.replace("max_tokens", "max_completion_tokens")
        return dataclasses.replace(error, message=message, param="max_completion_tokens")
    if error.param == "structured_output":
        sent = "response_format" if body.response_format is not None else "structured_outputs"
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
