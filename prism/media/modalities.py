"""The registry of modalities: what the stages iterate over where they treat every kind
of media alike. Adding one is a module beside `image.py` and a line here (and its fields
in the protos and its cap in the media flags)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prism.media.audio import AUDIO
from prism.media.embeds import IMAGE_EMBEDS
from prism.media.image import IMAGE
from prism.media.modality import Modality
from prism.media.video import VIDEO

if TYPE_CHECKING:
    from prism.config.common import MediaConfig

# The modalities that arrive as files, in the order their items travel everywhere: a
# stage proto holds each one's items in its own field, images before videos before audios.
MODALITIES: tuple[Modality, ...] = (IMAGE, VIDEO, AUDIO)
# Every modality by the `ContentPart` field it arrives in.
BY_PART: dict[str, Modality] = {m.part: m for m in (*MODALITIES, IMAGE_EMBEDS)}


def per_prompt(media: MediaConfig) -> dict[str, int]:
    """Each modality's cap on items per request, by name: vLLM's `limit_mm_per_prompt`."""
    return {m.name: getattr(media, m.cap) for m in MODALITIES}
