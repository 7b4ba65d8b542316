"""Media fetching, shared by every stage that takes media as files.

An item arrives as an http(s) URL, a data URL or raw bytes; what leaves here is the
original encoded bytes, checked by its modality (`Modality.files`). Decoding is left to
the stage that needs the pixels.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import yarl

from prism.cache import ByteLru
from prism.media.modality import Files, Modality
from prism.media.policy import MediaPolicy
from prism.media.url_guard import Allowance, GuardedResolver, Refused, check_host
from prism.proto.v1 import common_pb2, errors_pb2
from prism.rpc.errors import invalid
from prism.rpc.errors import unsupported_media as unsupported
from prism.tracing import tracer


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


def _files(modality: Modality) -> Files:
    if modality.files is None:
        raise TypeError(f"{modality.part} arrives as embeddings, not as files")
    return modality.files


class MediaLoader:
    """Loads a request's media files; one per process, reusing one HTTP session.

    Fetches follow redirects one hop at a time, each checked like the first, and reach
    public addresses only (`prism.media.url_guard`) unless the policy's `fetch_allow` admits
    more. Environment proxies are ignored: a proxy would connect where the guard cannot look.
    """

    _REDIRECTS = (301, 302, 303, 307, 308)

    def __init__(self, policy: MediaPolicy | None = None):
        self.policy = policy or MediaPolicy()
        # Keyed by modality and URL (a data URL's digest): the same URL loaded as another
        # modality is checked anew.
        self.url_cache: ByteLru[Any] = ByteLru(
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

    async def load(
        self, modality: Modality, media: common_pb2.Image | common_pb2.Video, param: str
    ) -> Any:
        """One item of `modality` (an Image, a Video...), checked: its loaded form."""
        with tracer.start_as_current_span(f"{modality.name}.load") as span:
            loaded = await self._load(modality, media, param)
            prefix = f"prism.{modality.name}"
            span.set_attribute(f"{prefix}.param", param)
            span.set_attributes({f"{prefix}.{k}": v for k, v in loaded.span_attributes().items()})
            return loaded

    async def _load(
        self, modality: Modality, media: common_pb2.Image | common_pb2.Video, param: str
    ) -> Any:
        files = _files(modality)
        source = media.WhichOneof("source")
        if source == "data":
            if media.mime_type and media.mime_type.lower() not in files.mime_types:
                raise unsupported(f"unsupported media type {media.mime_type!r}", param)
            return await self._check(files, media.data, param)
        if source != "url" or not media.url:
            raise invalid(f"{modality.name} has neither url nor data", param)
        url = media.url
        scheme = url.split(":", 1)[0].lower()
        if scheme == "data":
            # A conversation sends its images again with every turn: each is decoded and
            # checked once (keyed by a digest, not by the URL, whose size the cache does not
            # count).
            digest = hashlib.sha256(url.encode()).hexdigest()
            return await self._cached(
                f"{modality.name} data:{digest}",
                lambda: self._check(files, parse_data_url(url, files.mime_types, param), param),
            )
        if scheme in ("http", "https"):

            async def fetched() -> Any:
                data = await self._fetch(modality.name, files.max_bytes(self.policy), url, param)
                return await self._check(files, data, param)

            return await self._cached(f"{modality.name} {url}", fetched)
        raise invalid(
            f"unsupported {modality.name} URL scheme {scheme!r}: use http, https or data", param
        )

    async def _cached(self, key: str, load: Callable[[], Awaitable[Any]]) -> Any:
        """The item `key` names, loaded by `load` unless the cache holds it; a failure is not
        kept (the next request checks anew)."""
        loaded = self.url_cache.get(key)
        if loaded is None:
            loaded = await load()
            self.url_cache.put(key, loaded)
        return loaded

    async def _check(self, files: Files, data: bytes, param: str) -> Any:
        if files.in_thread:
            return await asyncio.to_thread(files.check, data, self.policy, param)
        return files.check(data, self.policy, param)

    async def _fetch(self, what: str, limit: int, url: str, param: str) -> bytes:
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
                        raise invalid(f"fetching {what} failed: HTTP {response.status}", param)
                    return await self._read(response, limit, what, param)
        except Refused as exc:
            raise invalid(
                f"{what} URL refused: {exc}", param, reason=errors_pb2.ERROR_REASON_URL_REFUSED
            ) from None
        except TimeoutError:
            raise invalid(f"fetching {what} timed out", param) from None
        except aiohttp.ClientError as exc:
            raise invalid(f"fetching {what} failed: {exc}", param) from None
        redirects = self.policy.max_redirects
        raise invalid(f"fetching {what} failed: more than {redirects} redirects", param)

    async def _read(
        self, response: aiohttp.ClientResponse, limit: int, what: str, param: str
    ) -> bytes:
        if (response.content_length or 0) > limit:
            raise invalid(f"{what} is larger than the limit of {limit} bytes", param)
        body = bytearray()
        async for chunk in response.content.iter_chunked(64 * 1024):
            body += chunk
            if len(body) > limit:
                raise invalid(f"{what} is larger than the limit of {limit} bytes", param)
        return bytes(body)
