"""Image embeddings that a client sends in place of an image (vLLM's `image_embeds`).

They arrive over HTTP as base64 safetensors, over gRPC as a typed `ImageEmbedding` (dtype,
shape, raw bytes). Nothing a client sends is ever unpickled: vLLM takes `torch.save`
output, which is a pickle, and this refuses it. Before any engine sees them, their shape is
checked against the model (hidden size; token count for the model's layout of one image):
vLLM documents that a wrong shape may crash its engine.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import safetensors

from prism.media.modality import IMAGE_TOKEN_KEYS, Modality
from prism.proto.stage.v1 import encoder_pb2, tensor_pb2
from prism.proto.v1 import common_pb2
from prism.rpc.errors import invalid

ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Pickle protocols 2-5 start with \x80; torch.save writes a zip archive (PK) of pickles.
_PICKLE_MAGIC = (b"\x80", b"PK\x03\x04")


def from_safetensors(data: bytes, param: str) -> common_pb2.ImageEmbedding:
    """The one tensor of a safetensors file, as an `ImageEmbedding` without a grid."""
    if data.startswith(_PICKLE_MAGIC):
        raise invalid("image_embeds must be safetensors; pickles (torch.save) are refused", param)
    try:
        tensors = safetensors.deserialize(data)
    except Exception as exc:  # the Rust parser's errors have no common Python base
        raise invalid(f"image_embeds is not a valid safetensors file: {exc}", param) from None
    if len(tensors) != 1:
        raise invalid(f"image_embeds must hold one tensor, not {len(tensors)}", param)
    ((_, tensor),) = tensors
    dtype = _SAFETENSORS_DTYPES.get(tensor["dtype"])
    if dtype is None:
        raise invalid(f"image_embeds dtype {tensor['dtype']} is not F32, F16 or BF16", param)
    return common_pb2.ImageEmbedding(dtype=dtype, shape=tensor["shape"], data=bytes(tensor["data"]))


@dataclass(frozen=True)
class Geometry:
    """What a model's embeddings of one image look like."""

    hidden_size: int
    # A fixed count of tokens per image (LLaVA), or None where a grid fixes it.
    tokens_per_image: int | None
    # Grid-placed families (Qwen2-VL): tokens are t*h*w / merge_size².
    merge_size: int = 0

    @classmethod
    def of(cls, config: Any) -> Geometry | None:
        """The geometry of an HF model config, or None for a family this does not know."""
        hidden = config.get_text_config().hidden_size
        if config.model_type == "llava":
            vision = config.vision_config
            tokens = (vision.image_size // vision.patch_size) ** 2
            if config.vision_feature_select_strategy == "full":
                tokens += 1
            return cls(hidden, tokens)
        if config.model_type in ("qwen2_vl", "qwen2_5_vl"):
            return cls(hidden, None, config.vision_config.spatial_merge_size)
        return None

    def tokens(self, grid: list[int], param: str) -> int:
        if self.tokens_per_image is not None:
            if grid:
                raise invalid("this model takes no image_grid_thw", param)
            return self.tokens_per_image
        if len(grid) != 3 or min(grid) <= 0:
            raise invalid("image_grid_thw must be three positive integers (t, h, w)", param)
        if grid[1] % self.merge_size or grid[2] % self.merge_size:
            raise invalid(
                f"image_grid_thw {grid}: h and w must be multiples of {self.merge_size}", param
            )
        return math.prod(grid) // self.merge_size**2


def check(embedding: common_pb2.ImageEmbedding, geometry: Geometry, param: str) -> None:
    """Holds an embedding to the model's geometry and to its own declared size."""
    size = ITEM_SIZES.get(embedding.dtype)
    if size is None:
        raise invalid(f"dtype must be one of {sorted(ITEM_SIZES)}, got {embedding.dtype!r}", param)
    shape = list(embedding.shape)
    tokens = geometry.tokens(list(embedding.image_grid_thw), param)
    if shape != [tokens, geometry.hidden_size]:
        raise invalid(
            f"image embeddings must have shape [{tokens}, {geometry.hidden_size}] for this "
            f"model (tokens, hidden size), got {shape}",
            param,
        )
    if len(embedding.data) != math.prod(shape) * size:
        raise invalid(
            f"shape {shape} of {embedding.dtype} is {math.prod(shape) * size} bytes, "
            f"but {len(embedding.data)} came",
            param,
        )


def to_handle(embedding: common_pb2.ImageEmbedding) -> encoder_pb2.EmbeddingHandle:
    """A checked embedding as the handle a worker reads: inline, named by its contents."""
    digest = hashlib.sha256(f"{embedding.dtype}{list(embedding.shape)}".encode())
    digest.update(embedding.data)
    return encoder_pb2.EmbeddingHandle(
        embeddings=tensor_pb2.TensorDescriptor(
            dtype=embedding.dtype, shape=embedding.shape, inline_data=embedding.data
        ),
        content_hash=digest.hexdigest(),
        grid_thw=embedding.image_grid_thw,
    )


# Stands in the prompt and reaches vLLM as an image does, and counts against the same cap;
# but it arrives checked and whole, so it loads nothing and goes past any encoder.
IMAGE_EMBEDS = Modality(
    name="image",
    part="image_embedding",
    field="images",
    cap="max_images",
    token_keys=IMAGE_TOKEN_KEYS,
)
