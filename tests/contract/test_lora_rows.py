"""vLLM's CPU LoRA ops leave the rows of base-model tokens (adapter index -1) alone once
Prism's engine process is set up (prism.engine.lora_rows), as vLLM's GPU kernels do; the
rows of adapted tokens are what vLLM computes."""

from __future__ import annotations

import torch
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from prism.engine import lora_rows


def test_a_base_tokens_row_is_left_alone_and_adapted_rows_computed():
    lora_rows.install()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(3, 8, generator=generator)
    weights = torch.randn(2, 1, 4, 8, generator=generator)  # two adapters, rank 4
    indices = torch.tensor([-1, 0, 1])
    shrunk = torch.full((3, 4), 7.0)
    punica_cpu.bgmv_shrink(inputs, weights, shrunk, indices, 0.5)
    assert torch.equal(shrunk[0], torch.full((4,), 7.0))
    for row in (1, 2):
        expected = 0.5 * weights[indices[row], 0] @ inputs[row]
        assert torch.allclose(shrunk[row], expected)
    expand = torch.randn(2, 1, 8, 4, generator=generator)
    out = torch.ones(3, 8)
    lora_ops.sgmv_expand(shrunk, expand, out, torch.tensor([0, 1, 2]), torch.tensor([1, 1, 1]),
                         indices, 3, 1, 3, add_inputs=True)  # fmt: skip
    assert torch.equal(out[0], torch.ones(8))
    assert torch.allclose(out[2], 1 + expand[1, 0] @ shrunk[2])


def test_one_index_of_no_adapter_for_every_row_leaves_them_all_alone():
    # vLLM's logits of a prompt's tokens (prompt logprobs) take one index per request.
    lora_rows.install()
    weights = torch.ones(2, 1, 4, 8)
    out = torch.full((7, 4), 3.0)
    punica_cpu.bgmv_shrink(torch.ones(7, 8), weights, out, torch.tensor([-1]), 1.0)
    assert torch.equal(out, torch.full((7, 4), 3.0))
    punica_cpu.bgmv_shrink(torch.ones(7, 8), weights, out, torch.tensor([1]), 1.0)
    assert torch.equal(out, torch.full((7, 4), 8.0))
