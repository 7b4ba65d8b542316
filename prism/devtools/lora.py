"""A random LoRA adapter of a checkpoint, in PEFT's format (adapter_config.json and
adapter_model.safetensors), so that tests and benchmarks serve adapters with no hub:
`prism model build-lora --base DIR --rank 8 --out DIR`.

It adapts every attention and MLP projection of the language model (never the vision or
audio towers: an adapter of a multimodal model changes how it answers, not how it sees).
Unlike PEFT's initialisation, whose B matrices start at zero (an adapter that changes
nothing), both matrices are random, so that each adapter answers differently from the base
and from the others; seeded, so that each build of the same seed is the same adapter.
"""

from __future__ import annotations

import json
import pathlib

# The language model's projections, as Llama and Qwen2 name them.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The towers' weights, by a part of their names (LLaVA's, Qwen2-VL's, Qwen2-Audio's).
TOWERS = ("vision", "visual", "audio", "multi_modal_projector")


def _targets(base: pathlib.Path) -> dict[str, tuple[int, int]]:
    """Each adapted module of the checkpoint at `base`: (out, in) features."""
    from safetensors import safe_open

    found = {}
    for shard in sorted(base.glob("*.safetensors")):
        with safe_open(shard, "pt") as weights:
            for key in weights.keys():  # noqa: SIM118 -- safe_open is not a mapping
                module, _, kind = key.rpartition(".")
                if (kind == "weight" and module.rpartition(".")[2] in TARGETS
                        and not any(tower in key for tower in TOWERS)):  # fmt: skip
                    out_features, in_features = weights.get_slice(key).get_shape()
                    found[module] = (out_features, in_features)
    if not found:
        raise ValueError(f"{base}: no safetensors weights of {', '.join(TARGETS)} to adapt")
    return found


def build_lora(base: pathlib.Path, out: pathlib.Path, rank: int = 8, seed: int = 0) -> pathlib.Path:
    """Writes an adapter of the checkpoint at `base` to `out`; returns `out`."""
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"the rank is at least 1, got {rank}")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_features, in_features) in sorted(_targets(base).items()):
        # Scaled so that the adapter's delta is of the order of the weights it adapts.
        a = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        b = torch.randn(out_features, rank, generator=generator) / rank**0.5
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
