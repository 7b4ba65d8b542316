"""Base-model tokens beside adapted ones on vLLM's CPU backend (imported in the engine
process).

vLLM marks a token that no LoRA adapter applies to with the adapter index -1. Its GPU
kernels skip such tokens; the PyTorch ops of its CPU backend (`torch_ops.lora_ops`, in
vLLM 0.32) index the stacked adapters with it instead, and -1 picks the last slot: in a
batch that mixes base-model requests with adapted ones, the base requests' tokens got an
adapter's delta and answered wrongly, without an error (vLLM pull request 48421, open).
Here each of those ops leaves the rows of -1 tokens as it found them, as the GPU kernels
do; the others are computed as before. On other platforms nothing changes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# The ops that gather the adapters by each token's index; the sgmv_* ops call these.
OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")


def _skipping(op: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(op)
    def skipped(
        inputs: torch.Tensor,
        weights: torch.Tensor,
        output: torch.Tensor,
        indices: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        unadapted = indices < 0
        if len(indices) == 1 and bool(unadapted.any()):
            # One index for every row (the logits of a prompt's tokens): no adapter at all.
            return None
        if not bool(unadapted.any()) or len(indices) != len(output):
            return op(inputs, weights, output, indices, *args, **kwargs)
        kept = output[unadapted].clone()
        result = op(inputs, weights, output, indices.clamp(min=0), *args, **kwargs)
        output[unadapted] = kept
        return result

    return skipped


def install() -> None:
    """Patches vLLM's CPU LoRA ops (once), where the sgmv ops and the CPU wrapper find
    them."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_prism_lora_rows", False):
        return
    lora_ops._prism_lora_rows = True
    for name in OPS:
        patched = _skipping(getattr(lora_ops, name))
        setattr(lora_ops, name, patched)
        setattr(punica_cpu, name, patched)
