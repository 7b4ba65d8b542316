"""vLLM's types that the worker stage names: its engine, what a request takes and gives
back, and the errors it raises. Imported by the worker only: `AsyncLLM` loads the engine."""

from __future__ import annotations

from vllm import SamplingParams, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.logprobs import FlatLogprobs
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

__all__ = [
    "AsyncLLM",
    "EngineDeadError",
    "FlatLogprobs",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TokensPrompt",
    "VLLMClientError",
]
