"""The deployment modes and the roles in the mesh: the one place modes are described.

A mode answers two questions: is there an encoder stage, and is decode apart (and then,
which engine role prefills: `prefill`, which takes images as embeddings from the
encoder, or `encode_prefill`, which encodes them itself)?
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class MeshRole(StrEnum):
    """A stage as the registry and the processor's routing know it."""

    PROCESSOR = "processor"
    ENCODER = "encoder"
    # An aggregated engine: prefill and decode in one.
    WORKER = "worker"
    PREFILL = "prefill"
    DECODE = "decode"


class EngineRole(StrEnum):
    """What a worker's engine does (`prism worker --role`)."""

    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    ENCODE_PREFILL = "encode_prefill"
    DECODE = "decode"

    @property
    def mesh_role(self) -> MeshRole:
        """The registry role it serves under."""
        if self == EngineRole.AGGREGATED:
            return MeshRole.WORKER
        return MeshRole.DECODE if self == EngineRole.DECODE else MeshRole.PREFILL


@dataclass(frozen=True)
class Mode:
    name: str
    has_encoder: bool
    # The engine role that prefills when decode is apart; None when one engine does both.
    prefill: EngineRole | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def roles(self) -> tuple[MeshRole, ...]:
        """The registry roles a request passes through after the processor, in order."""
        first = (MeshRole.ENCODER,) if self.has_encoder else ()
        if self.disaggregated:
            return (*first, MeshRole.PREFILL, MeshRole.DECODE)
        return (*first, MeshRole.WORKER)

    def __str__(self) -> str:
        return self.name


MODES = {
    mode.name: mode
    for mode in (
        Mode("epd", has_encoder=False),
        Mode("e/pd", has_encoder=True),
        Mode("e/p/d", has_encoder=True, prefill=EngineRole.PREFILL),
        Mode("ep/d", has_encoder=False, prefill=EngineRole.ENCODE_PREFILL),
    )
}


def mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


def modes_served(role: EngineRole | None = None, enable_mm_embeds: bool = False) -> tuple[str, ...]:
    """The modes a worker in `role` (or, without one, an encoder) can take part in."""
    if role is None:
        return tuple(name for name, mode in MODES.items() if mode.has_encoder)
    if role == EngineRole.AGGREGATED:
        # Precomputed embeddings are accepted beside images, not instead of them.
        return ("epd", "e/pd") if enable_mm_embeds else ("epd",)
    return tuple(
        name
        for name, mode in MODES.items()
        if mode.prefill is not None and role in (mode.prefill, EngineRole.DECODE)
    )
