"""What the model takes besides text, and where a prompt's media lie once the engine has
laid them out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prism.media.audio import AUDIO
from prism.media.embeds import Geometry
from prism.media.image import IMAGE
from prism.media.modalities import MODALITIES
from prism.media.modality import Modality
from prism.media.prompt import PromptMedia

# A media item as `kv_index.lay_out` takes it: its identifier and its count of tokens.
Item = tuple[str, int]
# A request's prompt, rendered and its media loaded: its token ids and its media.
Prompt = tuple[list[int], PromptMedia]


@dataclass(frozen=True)
class ModelInputs:
    """What the model takes besides text."""

    # The token id that stands for an item in a templated prompt, by modality name: one for
    # each modality the model takes.
    tokens: Mapping[str, int] = field(default_factory=dict)
    # Client image embeddings: their geometry, or None where the server does not take them.
    embeddings: Geometry | None = None
    embeddings_enabled: bool = False
    # The model's HF processor, which counts an image's tokens from its size; None where
    # nothing needs the count.
    processor: Any = field(default=None, compare=False, repr=False)
    # The HF config's `model_type`: whose way of counting a clip's tokens applies.
    model_type: str = ""

    @classmethod
    def of(cls, model: str, enable_mm_embeds: bool, count_tokens: bool = False) -> ModelInputs:
        # Here, not at the top: transformers' Auto classes load torch, which only a serving
        # processor needs, not the code that lays out a prompt.
        from transformers import AutoConfig, AutoProcessor

        config = AutoConfig.from_pretrained(model)
        tokens = {m.name: t for m in MODALITIES if (t := m.placeholder(config)) is not None}
        return cls(
            tokens=tokens,
            embeddings=Geometry.of(config) if enable_mm_embeds else None,
            embeddings_enabled=enable_mm_embeds,
            processor=AutoProcessor.from_pretrained(model) if count_tokens else None,
            model_type=config.model_type,
        )

    def token(self, modality: Modality) -> int | None:
        return self.tokens.get(modality.name)

    @property
    def placeholders(self) -> frozenset[int]:
        return frozenset(self.tokens.values())

    def media_items(self, media: PromptMedia) -> dict[int, list[Item]]:
        """The items of a prompt whose tokens are known, by placeholder token, each named by
        its content hash as workers name it to vLLM: images, image embeddings a client
        sent, and clips. Videos are left out: the frames a worker samples set their count."""
        items: dict[int, list[Item]] = {}
        image_token, audio_token = self.token(IMAGE), self.token(AUDIO)
        if image_token is not None:
            items[image_token] = self._images(media)
        if audio_token is not None:
            items[audio_token] = self._clips(media)
        return items

    def _images(self, media: PromptMedia) -> list[Item]:
        if media.image_embeddings:
            return [
                (handle.content_hash, handle.embeddings.shape[0])
                for handle in media.image_embeddings
            ]
        if not media.images or self.processor is None:
            return []
        # The HF processor's own count, which vLLM's expansion of these families matches.
        counts = self.processor._get_num_multimodal_tokens(
            image_sizes=[(image.height, image.width) for image in media.images]
        ).num_image_tokens
        return [
            (IMAGE.content_hash(image.data), count)
            for image, count in zip(media.images, counts, strict=True)
        ]

    def _clips(self, media: PromptMedia) -> list[Item]:
        """Qwen2-Audio's count of each clip's tokens (its HF processor's), up to the first
        clip at another rate than the model's: its length once resampled is the
        resampler's to say."""
        if self.processor is None or self.model_type != "qwen2_audio":
            return []
        extractor = self.processor.feature_extractor
        items = []
        for clip in media.audios:
            if clip.sample_rate != extractor.sampling_rate:
                break
            # Mel frames of the clip, cut to the extractor's window; then the tower's
            # stride-2 convolution and its pooling by 2.
            frames = -(-min(clip.frames, extractor.n_samples) // extractor.hop_length)
            items.append((AUDIO.content_hash(clip.data), ((frames - 1) // 2 - 1) // 2 + 1))
        return items
