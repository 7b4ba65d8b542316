"""The shape every modality has: one `Modality` per kind of media a request can bring,
named once, so that the stages iterate over the registry (`prism.media.modalities`)
instead of spelling out images and videos.

A modality is read from where it arrives (a `ContentPart` field), carried in the stage
protos' repeated field of its name (`EncodeRequest`, `MediaFiles`, `MediaEmbeddings`,
`MediaLayouts`), capped per request by a policy flag, stood for in the prompt by the
model's placeholder token, and handed to vLLM under its `multi_modal_data` key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prism.media.policy import MediaPolicy

# An image's placeholder token, whether the image comes as a file or as embeddings.
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")


def content_hash(data: bytes, factors: str = "") -> str:
    """What a media item is, from its encoded bytes and whatever else shapes its embeddings
    (`factors`: a video's frame sampling): the encoder's cache key, and the item's uuid in
    every engine, so that a processor routing by prefix caches knows each item's blocks."""
    return hashlib.sha256(f"{factors}\0".encode() + data).hexdigest()


@dataclass(frozen=True)
class Files:
    """How a modality that arrives as files (a URL or bytes) is loaded and checked."""

    mime_types: tuple[str, ...]
    # The policy's cap on one item's bytes, enforced while fetching.
    max_bytes: Callable[[MediaPolicy], int]
    # The encoded bytes checked (raising the request's error), as a loaded item with
    # `data`, `to_proto()` and `span_attributes()`.
    check: Callable[[bytes, MediaPolicy, str], Any]
    # Checks that take milliseconds to seconds (a video's header and frames): off the loop.
    in_thread: bool = False


@dataclass(frozen=True)
class Modality:
    # vLLM's key for it (`multi_modal_data`, `limit_mm_per_prompt`, `<name>_embeds`), the
    # chat template's part type, and the stem of its spans.
    name: str
    # The `prism.v1.ContentPart` field it arrives in.
    part: str
    # The repeated field that carries its items in the stage protos, and in `PromptMedia`.
    field: str
    # The `MediaPolicy` attribute (and flag) capping its items per request.
    cap: str
    # The HF model config's keys of its placeholder token id, the first set one wins.
    token_keys: tuple[str, ...]
    # How its files load; None where it arrives as embeddings, which nothing fetches.
    files: Files | None = None

    def items(self, message: Any) -> Sequence[Any]:
        """Its items in a message with a repeated field per modality."""
        return getattr(message, self.field)

    def limit(self, policy: MediaPolicy) -> int:
        return getattr(policy, self.cap)

    def placeholder(self, config: Any) -> int | None:
        """The token id that stands for one item in a templated prompt, from an HF config
        object or its config.json as a dict; None where the model does not take it."""
        for key in self.token_keys:
            value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
            if value is not None:
                return value
        return None

    def content_hash(self, data: bytes, sampling: Mapping[str, Any] | None = None) -> str:
        """`content_hash` of an item, with the settings that sample it (a video's frames)
        where they shape its embeddings."""
        return content_hash(data, f"{self.name} {sorted(sampling.items())}" if sampling else "")
