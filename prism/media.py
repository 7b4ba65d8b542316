"""Image and video fetching and validation, shared by every stage that takes media.

An image or a video arrives as an http(s) URL, a data URL or raw bytes; what leaves here
is the original encoded bytes, checked: an image to be a JPEG, PNG or WEBP within the byte
and pixel caps, a video as prism.video checks it. Decoding is left to the stage that needs
the pixels.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import PIL.Image
import yarl

from prism.cache import ByteLru
from prism.rpc.errors import check_size, invalid
from prism.rpc.errors import unsupported_media as unsupported
from prism.stage.v1 import encoder_pb2
from prism.tracing import tracer
from prism.url_guard import Allowance, GuardedResolver, Refused, check_host
from prism.v1 import common_pb2, errors_pb2
from prism.video import MIME_TYPES as VIDEO_MIME_TYPES
from prism.video import LoadedVideo, VideoLimits, check_video

MIME_BY_FORMAT = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


def content_hash(data: bytes, factors: str = "") -> str:
    """What a media item is, from its encoded bytes and whatever else shapes its embeddings
    (`factors`: a video's frame sampling): the encoder's cache key, and the item's uuid in
    every engine, so that a processor routing by prefix caches knows each item's blocks."""
    return hashlib.sha256(f"{factors}\0".encode() + data).hexdigest()


@dataclass(frozen=True)
class MediaPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    # Guards against decompression bombs: checked from the header, before decoding.
    max_image_pixels: int = 40_000_000
    max_images: int = 8
    max_videos: int = 4
    video: VideoLimits = field(default_factory=VideoLimits)
    connect_timeout_s: float = 5.0
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Host names or networks (CIDR) that URLs may reach although they are not public.
    fetch_allow: tuple[str, ...] = ()
    # Media fetched from http(s) URLs are kept this long (bytes) for repeated requests.
    url_cache_bytes: int = 64 * 1024 * 1024


def media_policy(args: argparse.Namespace) -> MediaPolicy:
    """The policy a stage's media flags (prism.cli) ask for."""
    return MediaPolicy(
        max_images=args.max_images,
        max_videos=args.max_videos,
        video=VideoLimits(
            max_bytes=args.max_video_mib * 2**20,
            max_seconds=args.max_video_seconds,
            max_frames=args.max_video_frames,
            max_pixels=args.max_video_pixels,
        ),
        fetch_allow=tuple(getattr(args, "fetch_allow", ())),
    )


@dataclass(frozen=True)
class LoadedImage:
    data: bytes
    mime_type: str
    width: int
    height: int

    def to_proto(self) -> common_pb2.Image:
        return common_pb2.Image(data=self.data, mime_type=self.mime_type)


@dataclass(frozen=True)
class PromptMedia:
    """A request's media, in prompt order within each modality."""

    images: list[LoadedImage] = field(default_factory=list)
    videos: list[LoadedVideo] = field(default_factory=list)
    # Image embeddings a client sent in place of images (never beside them), checked.
    image_embeddings: list[encoder_pb2.EmbeddingHandle] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.images or self.videos or self.image_embeddings)


def decode_image(data: bytes) -> PIL.Image.Image:
    """Pixels of checked image bytes, decoded exactly as vLLM decodes its own inputs."""
    from vllm.multimodal.media import ImageMediaIO  # heavy: only the stages that decode

    return ImageMediaIO().load_bytes(data).media


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


def parse_data_url(url: str, mime_types: tuple[str, ...], param: str) -> bytes:
    """The payload of a base64 data URL whose media type, if it names one, is one of
    `mime_types`."""
    header, sep, payload = url[len("data:") :].partition(",")
    if not sep:
        raise invalid("malformed data URL: no ',' before the payload", param)
    mime, *attrs = header.split(";")
    if mime and mime.lower() not in mime_types:
        raise unsupported(f"unsupported media type {mime!r}: use {', '.join(mime_types)}", param)
    if "base64" not in attrs:
        raise invalid("data URLs must be base64-encoded", param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("data URL payload is not valid base64", param) from None


@dataclass(frozen=True)
class _Kind:
    """What a loader does differently for images and for videos."""

    name: str
    mime_types: tuple[str, ...]
    max_bytes: Callable[[MediaPolicy], int]
    check: Callable[[bytes, MediaPolicy, str], Any]
    # Reading a video's header and two frames takes milliseconds to seconds: off the loop.
    in_thread: bool


IMAGE = _Kind(
    "image", tuple(MIME_BY_FORMAT.values()), lambda p: p.max_image_bytes, check_image, False
)
VIDEO = _Kind(
    "video",
    VIDEO_MIME_TYPES,
    lambda p: p.video.max_bytes,
    lambda data, policy, param: check_video(data, policy.video, param),
    True,
)


class MediaLoader:
    """Loads a request's images and videos; one per process, reusing one HTTP session.

    Fetches follow redirects one hop at a time, each checked like the first, and reach
    public addresses only (`prism.url_guard`) unless the policy's `fetch_allow` admits more.
    Environment proxies are ignored: a proxy would connect where the guard cannot look.
    """

    _REDIRECTS = (301, 302, 303, 307, 308)

    def __init__(self, policy: MediaPolicy | None = None):
        self.policy = policy or MediaPolicy()
        # Keyed by kind and URL: the same URL loaded as the other kind is checked anew.
        self.url_cache: ByteLru[LoadedImage | LoadedVideo] = ByteLru(
            self.policy.url_cache_bytes, size=lambda media: len(media.data)
        )
        self.allowance = Allowance(self.policy.fetch_allow)
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=GuardedResolver(self.allowance)),
            timeout=aiohttp.ClientTimeout(
                total=self.policy.fetch_timeout_s, connect=self.policy.connect_timeout_s
            ),
            trust_env=False,
        )

    async def close(self) -> None:
        await self._http.close()

    async def load(self, image: common_pb2.Image, param: str) -> LoadedImage:
        with tracer.start_as_current_span("image.load") as span:
            loaded = await self._load(IMAGE, image, param)
            span.set_attributes({
                "prism.image.param": param, "prism.image.bytes": len(loaded.data),
                "prism.image.mime_type": loaded.mime_type,
                "prism.image.width": loaded.width, "prism.image.height": loaded.height,
            })  # fmt: skip
            return loaded

    async def load_video(self, video: common_pb2.Video, param: str) -> LoadedVideo:
        with tracer.start_as_current_span("video.load") as span:
            loaded = await self._load(VIDEO, video, param)
            span.set_attributes({
                "prism.video.param": param, "prism.video.bytes": len(loaded.data),
                "prism.video.mime_type": loaded.mime_type, "prism.video.codec": loaded.codec,
                "prism.video.width": loaded.width, "prism.video.height": loaded.height,
                "prism.video.frames": loaded.frames,
            })  # fmt: skip
            return loaded

    async def _load(
        self, kind: _Kind, media: common_pb2.Image | common_pb2.Video, param: str
    ) -> Any:
        source = media.WhichOneof("source")
        if source == "data":
            if media.mime_type and media.mime_type.lower() not in kind.mime_types:
                raise unsupported(f"unsupported media type {media.mime_type!r}", param)
            return await self._check(kind, media.data, param)
        if source != "url" or not media.url:
            raise invalid(f"{kind.name} has neither url nor data", param)
        url = media.url
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            return await self._check(kind, parse_data_url(url, kind.mime_types, param), param)
        if scheme in ("http", "https"):
            cached = self.url_cache.get(f"{kind.name} {url}")
            if cached is not None:
                return cached
            loaded = await self._check(kind, await self._fetch(kind, url, param), param)
            self.url_cache.put(f"{kind.name} {url}", loaded)
            return loaded
        raise invalid(
            f"unsupported {kind.name} URL scheme {scheme!r}: use http, https or data", param
        )

    async def _check(self, kind: _Kind, data: bytes, param: str) -> Any:
        if kind.in_thread:
            return await asyncio.to_thread(kind.check, data, self.policy, param)
        return kind.check(data, self.policy, param)

    async def _fetch(self, kind: _Kind, url: str, param: str) -> bytes:
        try:
            for _ in range(self.policy.max_redirects + 1):
                target = yarl.URL(url)
                if target.scheme not in ("http", "https") or not target.host:
                    raise invalid(f"cannot fetch {url!r}: not an http(s) URL", param)
                check_host(target.host, self.allowance)
                async with self._http.get(target, allow_redirects=False) as response:
                    if response.status in self._REDIRECTS and "Location" in response.headers:
                        url = str(target.join(yarl.URL(response.headers["Location"])))
                        continue
                    if response.status != 200:
                        raise invalid(f"fetching {kind.name} failed: HTTP {response.status}", param)
                    return await self._read(response, kind.max_bytes(self.policy), kind, param)
        except Refused as exc:
            raise invalid(
                f"{kind.name} URL refused: {exc}", param, reason=errors_pb2.ERROR_REASON_URL_REFUSED
            ) from None
        except TimeoutError:
            raise invalid(f"fetching {kind.name} timed out", param) from None
        except aiohttp.ClientError as exc:
            raise invalid(f"fetching {kind.name} failed: {exc}", param) from None
        raise invalid(
            f"fetching {kind.name} failed: more than {self.policy.max_redirects} redirects", param
        )

    async def _read(
        self, response: aiohttp.ClientResponse, limit: int, kind: _Kind, param: str
    ) -> bytes:
        if (response.content_length or 0) > limit:
            raise invalid(f"{kind.name} is larger than the limit of {limit} bytes", param)
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > limit:
                raise invalid(f"{kind.name} is larger than the limit of {limit} bytes", param)
        return bytes(body)
