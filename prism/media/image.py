"""Images: encoded JPEG, PNG or WEBP bytes, checked within the byte and pixel caps from
their header before anything decodes them, and decoded (by the stages that need pixels)
exactly as vLLM decodes its own inputs."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import PIL.Image

from prism.engine import media_io
from prism.media.modality import IMAGE_TOKEN_KEYS, Files, Modality
from prism.proto.v1 import common_pb2
from prism.rpc.errors import check_size, invalid
from prism.rpc.errors import unsupported_media as unsupported

if TYPE_CHECKING:
    from prism.media.policy import MediaPolicy

MIME_BY_FORMAT = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


@dataclass(frozen=True)
class LoadedImage:
    data: bytes
    mime_type: str
    width: int
    height: int

    def to_proto(self) -> common_pb2.Image:
        return common_pb2.Image(data=self.data, mime_type=self.mime_type)

    def span_attributes(self) -> dict[str, Any]:
        return {"bytes": len(self.data), "mime_type": self.mime_type,
                "width": self.width, "height": self.height}  # fmt: skip


def decode_image(data: bytes) -> PIL.Image.Image:
    """Pixels of checked image bytes, decoded exactly as vLLM decodes its own inputs."""
    return media_io.load_image(data)


def check_image(data: bytes, policy: MediaPolicy, param: str) -> LoadedImage:
    """Checks format, size and integrity of encoded image bytes."""
    check_size(data, "image", policy.max_image_bytes, param)
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            fmt = image.format or ""
            if fmt not in MIME_BY_FORMAT:
                raise unsupported(
                    f"unsupported image format {fmt or 'unknown'}: use JPEG, PNG or WEBP", param
                )
            width, height = image.size
            if width * height > policy.max_image_pixels:
                raise invalid(
                    f"image is {width}x{height} pixels, more than the limit of "
                    f"{policy.max_image_pixels}",
                    param,
                )
            image.verify()
    except PIL.UnidentifiedImageError:
        raise unsupported("not an image: use JPEG, PNG or WEBP", param) from None
    except (OSError, SyntaxError, ValueError, PIL.Image.DecompressionBombError) as exc:
        raise invalid(f"image cannot be decoded: {exc}", param) from None
    return LoadedImage(data, MIME_BY_FORMAT[fmt], width, height)


IMAGE = Modality(
    name="image",
    part="image",
    field="images",
    cap="max_images",
    token_keys=IMAGE_TOKEN_KEYS,
    files=Files(
        mime_types=tuple(MIME_BY_FORMAT.values()),
        max_bytes=lambda policy: policy.max_image_bytes,
        check=check_image,
    ),
)
