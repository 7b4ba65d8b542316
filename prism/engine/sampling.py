"""Conversion of the wire `SamplingParams` into vLLM's, with vLLM's own validation."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from transformers import PreTrainedTokenizerBase
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from prism.proto.v1 import common_pb2
from prism.rpc.errors import invalid

_OPTIONAL = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "stream_interval",
)
# What vLLM's structured-output check reads of the model's config.
_NOT_DIFFUSION = SimpleNamespace(is_diffusion=False)


def to_vllm(params: common_pb2.SamplingParams, **overrides: Any) -> VllmSamplingParams:
    """vLLM SamplingParams for `params`; unset fields keep vLLM's defaults.

    Raises INVALID_ARGUMENT naming the parameter when vLLM rejects a value.
    """
    kwargs: dict[str, Any] = {
        name: getattr(params, name) for name in _OPTIONAL if params.HasField(name)
    }
    if "max_tokens" not in kwargs:
        # vLLM then fills in the room left in the context after the prompt.
        kwargs["max_tokens"] = None
    kwargs.update(
        min_tokens=params.min_tokens,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        include_stop_str_in_output=params.include_stop_str_in_output,
        logit_bias=dict(params.logit_bias) or None,
        structured_outputs=structured_outputs(params.structured_output),
    )
    kwargs.update(overrides)
    try:
        return VllmSamplingParams(**kwargs)
    except VLLMValidationError as exc:
        raise invalid(str(exc), param=exc.parameter) from None
    except (ValueError, TypeError) as exc:
        raise invalid(str(exc)) from None


def structured_outputs(wire: common_pb2.StructuredOutput) -> StructuredOutputsParams | None:
    kind = wire.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        try:
            # As vLLM's server passes it: the schema itself, not its text.
            schema = json.loads(wire.json_schema)
        except json.JSONDecodeError as exc:
            raise invalid(f"the JSON schema is not JSON: {exc}", "structured_output") from None
        return StructuredOutputsParams(json=schema)
    if kind == "json_object":
        if not wire.json_object:
            raise invalid("json_object must be true if set", "structured_output")
        return StructuredOutputsParams(json_object=True)
    if kind == "choice":
        return StructuredOutputsParams(choice=list(wire.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(wire, kind)})


def check_structured_output(params: VllmSamplingParams, tokenizer: PreTrainedTokenizerBase) -> None:
    """vLLM's own check of `params`' structured output against the tokenizer, with the
    default structured-output config. Raises INVALID_ARGUMENT for `structured_output`."""
    try:
        params._validate_structured_outputs(_NOT_DIFFUSION, StructuredOutputsConfig(),
                                            tokenizer)  # fmt: skip
    except (ValueError, VLLMClientError) as exc:
        raise invalid(str(exc), "structured_output") from None
