"""The LoRA adapters an engine answers with: vLLM's `LoRARequest` for each adapter a request
names, the adapter loaded into the engine (and so checked) before the first request that
names it is scheduled.

A request carries its adapter's name and path (prism.stage.v1.LoraAdapter), so that a
worker serves every adapter the mesh holds, a restarted or newly started one included,
with nothing to be told beforehand. vLLM tells adapters apart by an int id for the
engine's life: one per (name, path) here. An adapter that cannot be loaded (a corrupt
directory, a rank above --max-lora-rank, LoRA not enabled) fails its request with the
cause before the engine core would meet it mid-step, where it would stop the engine.
"""

from __future__ import annotations

from vllm.lora.request import LoRARequest

from prism import telemetry
from prism.engine.types import AsyncLLM

__all__ = ["LoRARequest", "LoraAdapters"]


class LoraAdapters:
    """One engine's adapters, each loaded once, by the name and path requests give."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self._ids: dict[tuple[str, str], int] = {}
        self._loaded: set[int] = set()
        # Ids are never reused: vLLM may still hold a dropped one's weights in its cache.
        self._next_id = 1

    @property
    def max_loras(self) -> int:
        """How many adapters the engine applies at once (vLLM's --max-loras; 0 without
        LoRA)."""
        config = self.engine.vllm_config.lora_config
        return config.max_loras if config else 0

    async def request(self, name: str, path: str) -> LoRARequest | None:
        """The adapter `name` at `path` as vLLM takes it, loaded into the engine; None for
        the base model (no name). Raises ValueError naming the cause if it cannot be
        loaded."""
        if not name:
            return None
        lora_id = self._ids.get((name, path))
        if lora_id is None:
            lora_id = self._ids[(name, path)] = self._next_id
            self._next_id += 1
        lora = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
        if lora_id not in self._loaded:
            if not self.engine.vllm_config.lora_config:
                raise ValueError(
                    f"adapter {name!r}: LoRA is not enabled (start with --enable-lora)"
                )
            try:
                await self.engine.add_lora(lora)
            except Exception as exc:  # vLLM's loader raises what the files make it raise
                raise ValueError(f"adapter {name!r} cannot be loaded from {path}: {exc}") from None
            self._loaded.add(lora_id)
            telemetry.LORA_LOADED.labels(name).set(1)
        return lora

    async def drop(self, name: str) -> bool:
        """Unloads adapter `name` (every path it was loaded from); whether the engine held
        it. A request naming it again loads it again."""
        held = [(key, lora_id) for key, lora_id in self._ids.items() if key[0] == name]
        dropped = False
        for key, lora_id in held:
            del self._ids[key]
            if lora_id in self._loaded:
                self._loaded.discard(lora_id)
                dropped = bool(await self.engine.remove_lora(lora_id)) or dropped
        if held:
            telemetry.LORA_LOADED.remove(name)
        return dropped
