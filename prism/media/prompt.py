"""A request's media once loaded and checked, as the processor's pipeline takes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prism.media.audio import LoadedAudio
from prism.media.image import LoadedImage
from prism.media.modalities import MODALITIES
from prism.media.modality import Modality
from prism.media.video import LoadedVideo
from prism.proto.stage.v1 import encoder_pb2


@dataclass(frozen=True)
class PromptMedia:
    """A request's media, in prompt order within each modality; each file modality's items
    in the field the modality names."""

    images: list[LoadedImage] = field(default_factory=list)
    videos: list[LoadedVideo] = field(default_factory=list)
    audios: list[LoadedAudio] = field(default_factory=list)
    # Image embeddings a client sent in place of images (never beside them), checked.
    image_embeddings: list[encoder_pb2.EmbeddingHandle] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.has_files or bool(self.image_embeddings)

    def files(self, modality: Modality) -> list[Any]:
        """The loaded files of a modality that arrives as files."""
        return getattr(self, modality.field)

    @property
    def has_files(self) -> bool:
        return any(self.files(modality) for modality in MODALITIES)
