"""Image fetching and validation, shared by every stage that takes images.

An image arrives as an http(s) URL, a data URL or raw bytes; what leaves here is the
original encoded bytes, checked to be a JPEG, PNG or WEBP within the byte and pixel caps.
Decoding to pixels is left to the stage that needs them.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

import httpx
import PIL.Image

from prism.cache import ByteLru
from prism.rpc import PrismError, invalid
from prism.tracing import tracer
from prism.v1 import common_pb2

MIME_BY_FORMAT = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}
UNSUPPORTED = "UNSUPPORTED_MEDIA_TYPE"


@dataclass(frozen=True)
class MediaPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    # Guards against decompression bombs: checked from the header, before decoding.
    max_image_pixels: int = 40_000_000
    max_images: int = 8
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Images fetched from http(s) URLs are kept this long (bytes) for repeated requests.
    url_cache_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True)
class LoadedImage:
    data: bytes
    mime_type: str
    width: int
    height: int

    def to_proto(self) -> common_pb2.Image:
        return common_pb2.Image(data=self.data, mime_type=self.mime_type)


def decode_image(data: bytes) -> PIL.Image.Image:
    """Pixels of checked image bytes, decoded exactly as vLLM decodes its own inputs."""
    from vllm.multimodal.media import ImageMediaIO  # heavy: only the stages that decode

    return ImageMediaIO().load_bytes(data).media


def unsupported(message: str, param: str) -> PrismError:
    return invalid(message, param=param, reason=UNSUPPORTED)


def check_image(data: bytes, policy: MediaPolicy, param: str) -> LoadedImage:
    """Checks format, size and integrity of encoded image bytes."""
    if not data:
        raise invalid("image is empty", param)
    if len(data) > policy.max_image_bytes:
        raise invalid(
            f"image is {len(data)} bytes, more than the limit of {policy.max_image_bytes}", param
        )
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


def parse_data_url(url: str, param: str) -> bytes:
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise invalid("malformed data URL: no ',' before the payload", param)
    mime, *attrs = header.split(";")
    if mime and mime.lower() not in MIME_BY_FORMAT.values():
        raise unsupported(f"unsupported media type {mime!r}: use JPEG, PNG or WEBP", param)
    if "base64" not in attrs:
        raise invalid("data URL images must be base64-encoded", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("data URL payload is not valid base64", param) from None


class ImageLoader:
    """Loads images for requests; one per process, reusing one HTTP client."""

    def __init__(self, policy: MediaPolicy | None = None):
        self.policy = policy or MediaPolicy()
        self.url_cache: ByteLru[LoadedImage] = ByteLru(
            self.policy.url_cache_bytes, size=lambda image: len(image.data)
        )
        self._http = httpx.AsyncClient(
            follow_redirects=True,
            max_redirects=self.policy.max_redirects,
            timeout=httpx.Timeout(self.policy.fetch_timeout_s),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def load(self, image: common_pb2.Image, param: str) -> LoadedImage:
        with tracer.start_as_current_span("image.load") as span:
            loaded = await self._load(image, param)
            span.set_attributes({
                "prism.image.param": param, "prism.image.bytes": len(loaded.data),
                "prism.image.mime_type": loaded.mime_type,
                "prism.image.width": loaded.width, "prism.image.height": loaded.height,
            })  # fmt: skip
            return loaded

    async def _load(self, image: common_pb2.Image, param: str) -> LoadedImage:
        source = image.WhichOneof("source")
        if source == "data":
            if image.mime_type and image.mime_type.lower() not in MIME_BY_FORMAT.values():
                raise unsupported(f"unsupported media type {image.mime_type!r}", param)
            return check_image(image.data, self.policy, param)
        if source != "url" or not image.url:
            raise invalid("image has neither url nor data", param)
        url = image.url
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return check_image(parse_data_url(url, param), self.policy, param)
        if scheme in ("http", "https"):
            cached = self.url_cache.get(url)
            if cached is not None:
                return cached
            loaded = check_image(await self._fetch(url, param), self.policy, param)
            self.url_cache.put(url, loaded)
            return loaded
        raise invalid(f"unsupported image URL scheme {scheme!r}: use http, https or data", param)

    async def _fetch(self, url: str, param: str) -> bytes:
        limit = self.policy.max_image_bytes
        try:
            async with self._http.stream("GET", url) as response:
                if response.status_code != 200:
                    raise invalid(f"fetching image failed: HTTP {response.status_code}", param)
                declared = response.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limit:
                    raise invalid(f"image is larger than the limit of {limit} bytes", param)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise invalid(f"image is larger than the limit of {limit} bytes", param)
                return bytes(body)
        except httpx.TooManyRedirects:
            raise invalid("fetching image failed: too many redirects", param) from None
        except httpx.TimeoutException:
            raise invalid("fetching image timed out", param) from None
        except httpx.HTTPError as exc:
            raise invalid(f"fetching image failed: {exc}", param) from None
