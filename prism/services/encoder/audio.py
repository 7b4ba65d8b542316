"""A checkpoint's audio path (Qwen2-Audio's Whisper-style tower + projector): clips to
the embeddings vLLM would compute for them, the same steps as its
`Qwen2AudioForConditionalGeneration._process_audio_input`, so that a worker handed these
answers as one that heard the clips."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from prism.media.audio import AudioDecoder


class AudioPath:
    """Clips (encoded bytes) to one embedding tensor (tokens, hidden) each, with the
    model's feature extractor, tower and projector, in `model`'s device and dtype."""

    def __init__(
        self,
        model: Any,
        feature_extractor: Any,
        decoder: AudioDecoder,
        on_device: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.tower = model.audio_tower
        self.projector = model.multi_modal_projector
        self.feature_extractor = feature_extractor
        self.decoder = decoder
        self.on_device = on_device

    def features(self, clips: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """The clips' mel features, each padded (or cut) to the extractor's window, and
        how many of each one's frames are the clip's: as vLLM asks the HF processor."""
        samples = [self.decoder.decode(data)[0] for data in clips]
        inputs = self.feature_extractor(
            samples,
            sampling_rate=self.feature_extractor.sampling_rate,
            truncation=True,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        return inputs["input_features"], inputs["attention_mask"].sum(-1)

    def __call__(self, features: torch.Tensor, frames: torch.Tensor) -> list[torch.Tensor]:
        """Each clip's embeddings: the tower over the batch, its padding masked out, the
        projector, then each clip's own tokens."""
        tower = self.tower
        frames = frames.to(tower.conv1.weight.device)
        lengths, tokens = tower._get_feat_extract_output_lengths(frames)
        batch, _, mel_frames = features.shape
        positions = (mel_frames - 2) // 2 + 1
        padding = torch.arange(positions, device=lengths.device).expand(batch, positions)
        padding = padding >= lengths.unsqueeze(-1)
        # vLLM's additive mask: -inf at the padding, for every query.
        mask = padding.view(batch, 1, 1, positions).expand(batch, 1, positions, positions)
        additive = torch.zeros(mask.shape, dtype=tower.conv1.weight.dtype, device=mask.device)
        additive[mask] = float("-inf")
        hidden = tower(self.on_device(features), attention_mask=additive).last_hidden_state
        projected = self.projector(hidden)
        return [projected[i, : int(tokens[i])].contiguous() for i in range(batch)]
