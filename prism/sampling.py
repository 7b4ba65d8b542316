"""Conversion of the wire `SamplingParams` into vLLM's, with vLLM's own validation."""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.exceptions import VLLMValidationError

from prism.rpc import invalid
from prism.v1 import common_pb2

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
)


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
    )
    kwargs.update(overrides)
    try:
        return VllmSamplingParams(**kwargs)
    except VLLMValidationError as exc:
        raise invalid(str(exc), param=exc.parameter) from None
    except (ValueError, TypeError) as exc:
        raise invalid(str(exc)) from None
