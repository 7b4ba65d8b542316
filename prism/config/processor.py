"""The processor's settings: its mode, and what it does when a stage fails it."""

from __future__ import annotations

from dataclasses import dataclass

from prism.config.flags import Flags, flag
from prism.modes import MODES


@dataclass
class ProcessorConfig(Flags):
    """`prism processor`'s own flags."""

    mode: str = flag("epd", "the mesh's mode: which stages a request passes through",
                     choices=MODES, always=True)  # fmt: skip
    enable_mm_embeds: bool = flag(False, "take image embeddings from clients (image_embeds parts)")
    migration_limit: int = flag(
        1, "times a request moves to another worker replica when the one streaming it dies"
    )
    no_encoder_fallback: bool = flag(
        False,
        "fail a request whose images or videos no encoder can take (none serving, all "
        "full, the encode failed) rather than have the worker encode them from the pixels",
    )
