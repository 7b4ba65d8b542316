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

import aiohttp
import PIL.Image
import yarl

from prism.cache import ByteLru
from prism.rpc import PrismError, invalid
from prism.tracing import tracer
from prism.url_guard import Allowance, GuardedResolver, Refused, check_host
from prism.v1 import common_pb2, errors_pb2

MIME_BY_FORMAT = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


@dataclass(frozen=True)
class MediaPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    # Guards against decompression bombs: checked from the header, before decoding.
    max_image_pixels: int = 40_000_000
    max_images: int = 8
    connect_timeout_s: float = 5.0
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Host names or networks (CIDR) that URLs may reach although they are not public.
    fetch_allow: tuple[str, ...] = ()
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
    return invalid(message, param=param, reason=errors_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE)


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
    """Loads images for requests; one per process, reusing one HTTP session.

    Fetches follow redirects one hop at a time, each checked like the first, and reach
    public addresses only (`prism.url_guard`) unless the policy's `fetch_allow` admits more.
    Environment proxies are ignored: a proxy would connect where the guard cannot look.
    """

    _REDIRECTS = (301, 302, 303, 307, 308)

    def __init__(self, policy: MediaPolicy | None = None):
        self.policy = policy or MediaPolicy()
        self.url_cache: ByteLru[LoadedImage] = ByteLru(
            self.policy.url_cache_bytes, size=lambda image: len(image.data)
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
                        raise invalid(f"fetching image failed: HTTP {response.status}", param)
                    return await self._read(response, param)
        except Refused as exc:
            raise invalid(
                f"image URL refused: {exc}", param, reason=errors_pb2.ERROR_REASON_URL_REFUSED
            ) from None
        except TimeoutError:
            raise invalid("fetching image timed out", param) from None
        except aiohttp.ClientError as exc:
            raise invalid(f"fetching image failed: {exc}", param) from None
        raise invalid(
            f"fetching image failed: more than {self.policy.max_redirects} redirects", param
        )

    async def _read(self, response: aiohttp.ClientResponse, param: str) -> bytes:
        limit = self.policy.max_image_bytes
        if (response.content_length or 0) > limit:
            raise invalid(f"image is larger than the limit of {limit} bytes", param)
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > limit:
                raise invalid(f"image is larger than the limit of {limit} bytes", param)
        return bytes(body)
