"""What the worker asks of its vLLM engine beyond `generate`, `abort` and `check_health`,
in one place: vLLM's renderer (a prompt's media laid out before it runs), Prism's calls
into the engine process (prism.engine.extension), and the inputs vLLM takes for
precomputed embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from prism.engine.types import AsyncLLM, TokensPrompt
from prism.proto.stage.v1 import engine_pb2


async def render(
    engine: AsyncLLM, prompt: TokensPrompt
) -> tuple[Any, dict[str, list[engine_pb2.MediaLayout]]]:
    """`prompt` as the engine will run it (its media processed), and how each item of
    each modality (by name) was laid out: what a decode engine needs."""
    (engine_input,) = await engine.renderer.render_cmpl_async([prompt], skip_mm_cache=True)
    return engine_input, media_layouts(engine_input)


def media_layouts(engine_input: Any) -> dict[str, list[engine_pb2.MediaLayout]]:
    """How vLLM laid out each item of a rendered prompt, by modality name."""
    if engine_input.get("type") != "multimodal":
        return {}
    layouts: dict[str, list[engine_pb2.MediaLayout]] = {}
    for name, placeholders in engine_input["mm_placeholders"].items():
        items = engine_input["mm_kwargs"].get(name, [])
        hashes = engine_input["mm_hashes"].get(name, [])
        grid_key = f"{name}_grid_thw"
        for index, placeholder in enumerate(placeholders):
            item = items[index]
            grid = item[grid_key].data.tolist() if grid_key in item else []
            seconds = item["second_per_grid_ts"].data.item() if "second_per_grid_ts" in item else 0
            layouts.setdefault(name, []).append(
                engine_pb2.MediaLayout(
                    uuid=hashes[index],
                    num_tokens=placeholder.length,
                    grid_thw=grid,
                    second_per_grid_ts=seconds,
                )
            )
    return layouts


async def kv_held(engine: AsyncLLM, request_ids: list[str]) -> list[str]:
    """Those of `request_ids` (finished prefills) whose KV the engine still holds for a
    decode to read: vLLM frees it once read, which only its connector learns."""
    (held,) = await engine.collective_rpc("prism_kv_held", args=(request_ids,))
    return held


async def release_kv(engine: AsyncLLM, request_id: str) -> str:
    """Ends the lease on the KV a finished prefill holds: "released", "pending" or "gone"
    (prism.engine.extension, whose module the worker does not import: importing it sets
    up the engine process)."""
    (release,) = await engine.collective_rpc("prism_release_kv", args=(request_id,))
    return release


def placeholder_embeddings(engine: AsyncLLM, num_tokens: int) -> torch.Tensor:
    """Zero embeddings of `num_tokens` tokens, of the size and dtype the model takes."""
    config = engine.model_config
    return torch.zeros(num_tokens, config.get_inputs_embeds_size(), dtype=config.dtype)


def embeddings_input(
    modality: str,
    tensors: list[torch.Tensor],
    grids: Sequence[Sequence[int]],
    seconds: Sequence[float] = (),
) -> object:
    """Precomputed embeddings of one modality in the form vLLM takes for the model's family;
    `seconds`: each video's seconds per temporal patch, where the family places video
    tokens in time (Qwen2.5-VL)."""
    if any(grids):
        # Qwen2-VL: one (tokens, hidden) block for all items, and each item's grid.
        grid = torch.tensor([list(thw) for thw in grids])
        data = {f"{modality}_embeds": torch.cat(tensors), f"{modality}_grid_thw": grid}
        if any(seconds):
            data["second_per_grid_ts"] = torch.tensor(list(seconds))
        return data
    if len({tensor.shape for tensor in tensors}) == 1:
        # A 3-D tensor is read as (items, tokens, hidden); a 2-D one would be many items.
        return torch.stack(tensors)
    return tensors
