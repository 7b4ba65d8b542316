"""What the model takes besides text, and where a prompt's media lie once the engine has
laid them out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prism.embeds import Geometry
from prism.media import PromptMedia, content_hash

# A media item as `kv_index.lay_out` takes it: its identifier and its count of tokens.
Item = tuple[str, int]
# A request's prompt, rendered and its media loaded: its token ids and its media.
Prompt = tuple[list[int], PromptMedia]


@dataclass(frozen=True)
class ModelInputs:
    """What the model takes besides text."""

    video: bool = False
    # Client image embeddings: their geometry, or None where the server does not take them.
    embeddings: Geometry | None = None
    embeddings_enabled: bool = False
    # The token ids that stand for an image and a video in a templated prompt.
    image_token: int | None = None
    video_token: int | None = None
    # The model's HF processor, which counts an image's tokens from its size; None where
    # nothing needs the count.
    processor: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, model: str, enable_mm_embeds: bool, count_tokens: bool = False) -> ModelInputs:
        # Here, not at the top: transformers' Auto classes load torch, which only a serving
        # processor needs, not the code that lays out a prompt.
        from transformers import AutoConfig, AutoProcessor

        config = AutoConfig.from_pretrained(model)
        image_token = getattr(config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(config, "image_token_index", None)
        video_token = getattr(config, "video_token_id", None)
        return cls(
            video=video_token is not None,
            embeddings=Geometry.of(config) if enable_mm_embeds else None,
            embeddings_enabled=enable_mm_embeds,
            image_token=image_token,
            video_token=video_token,
            processor=AutoProcessor.from_pretrained(model) if count_tokens else None,
        )

    @property
    def placeholders(self) -> frozenset[int]:
        return frozenset(t for t in (self.image_token, self.video_token) if t is not None)

    def media_items(self, media: PromptMedia) -> dict[int, list[Item]]:
        """The items of a prompt whose tokens are known, by placeholder token: images, or
        image embeddings a client sent, named by their content hash as workers name them to
        vLLM. Videos are left out: the frames a worker samples set their count."""
        if self.image_token is None:
            return {}
        if media.image_embeddings:
            return {self.image_token: [
                (handle.content_hash, handle.embeddings.shape[0])
                for handle in media.image_embeddings
            ]}  # fmt: skip
        if not media.images or self.processor is None:
            return {}
        # The HF processor's own count, which vLLM's expansion of these families matches.
        counts = self.processor._get_num_multimodal_tokens(
            image_sizes=[(image.height, image.width) for image in media.images]
        ).num_image_tokens
        return {self.image_token: [
            (content_hash(image.data), count)
            for image, count in zip(media.images, counts, strict=True)
        ]}  # fmt: skip
