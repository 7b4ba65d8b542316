"""Unit tests: image validation and data URLs (no network beyond loopback)."""

import asyncio
import base64
import io

import PIL.Image
import pytest
from support.content import png
from support.meshes import ALLOWED_HOST

from prism.media.fetch import MediaLoader, parse_data_url
from prism.media.image import IMAGE, check_image
from prism.media.policy import MediaPolicy
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError


def encode(fmt: str, size=(8, 8)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", size, (1, 2, 3)).save(buffer, fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"),
                                      ("WEBP", "image/webp")])  # fmt: skip
def test_accepted_formats(fmt, mime):
    image = check_image(encode(fmt), MediaPolicy(), "p")
    assert image.mime_type == mime and (image.width, image.height) == (8, 8)


@pytest.mark.parametrize(
    "data,reason",
    [
        (encode("GIF"), "UNSUPPORTED_MEDIA_TYPE"),
        (encode("BMP"), "UNSUPPORTED_MEDIA_TYPE"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "UNSUPPORTED_MEDIA_TYPE"),
        (b"hello", "UNSUPPORTED_MEDIA_TYPE"),
        (b"", "INVALID_ARGUMENT"),
        (png(1)[:-30], "INVALID_ARGUMENT"),
    ],
    ids=["gif", "bmp", "svg", "text", "empty", "truncated"],
)
def test_rejected_images(data, reason):
    with pytest.raises(PrismError) as info:
        check_image(data, MediaPolicy(), "img")
    assert info.value.reason_name == reason
    assert info.value.param == "img"
    assert info.value.http_status == (415 if reason == "UNSUPPORTED_MEDIA_TYPE" else 400)


def test_pixel_cap_is_checked_before_decoding():
    with pytest.raises(PrismError, match="pixels"):
        check_image(encode("PNG", (100, 100)), MediaPolicy(max_image_pixels=9999), "p")


def test_byte_cap():
    with pytest.raises(PrismError, match="bytes"):
        check_image(png(1), MediaPolicy(max_image_bytes=100), "p")


def test_data_urls():
    raw = png(1)
    assert (
        parse_data_url(
            "data:image/png;base64," + base64.b64encode(raw).decode(), IMAGE.files.mime_types, "p"
        )
        == raw
    )
    with pytest.raises(PrismError) as info:
        parse_data_url("data:image/svg+xml;base64,AAAA", IMAGE.files.mime_types, "p")
    assert info.value.http_status == 415
    for bad in ("data:image/png;base64", "data:image/png,plain", "data:image/png;base64,@@"):
        with pytest.raises(PrismError):
            parse_data_url(bad, IMAGE.files.mime_types, "p")


def test_loader_fetches_from_loopback(image_server):
    url = image_server("/media-test.png", png(7))
    missing = image_server("/exists.png", b"").replace("exists", "missing")

    async def run():
        loader = MediaLoader(MediaPolicy(fetch_allow=(ALLOWED_HOST,)))
        try:
            image = await loader.load(IMAGE, common_pb2.Image(url=url), "p")
            assert image.data == png(7)
            assert (await loader.load(IMAGE, common_pb2.Image(url=url), "p")).data == png(7)
            assert (loader.url_cache.stats.hits, loader.url_cache.stats.misses) == (1, 1)
            with pytest.raises(PrismError, match="HTTP 404"):
                await loader.load(IMAGE, common_pb2.Image(url=missing), "p")
            raw = await loader.load(
                IMAGE, common_pb2.Image(data=png(7), mime_type="image/png"), "p"
            )
            assert raw.data == png(7)
            with pytest.raises(PrismError):
                await loader.load(IMAGE, common_pb2.Image(url="file:///etc/passwd"), "p")
        finally:
            await loader.close()

    asyncio.run(run())


def test_a_data_url_sent_again_is_checked_once_and_a_bad_one_every_time():
    good = "data:image/png;base64," + base64.b64encode(png(5)).decode()
    bad = "data:image/png;base64," + base64.b64encode(b"just text").decode()

    async def run():
        loader = MediaLoader(MediaPolicy())
        try:
            for _ in range(3):
                assert (await loader.load(IMAGE, common_pb2.Image(url=good), "p")).data == png(5)
            assert (loader.url_cache.stats.hits, loader.url_cache.stats.misses) == (2, 1)
            for _ in range(2):
                with pytest.raises(PrismError) as refused:
                    await loader.load(IMAGE, common_pb2.Image(url=bad), "p")
                assert refused.value.http_status == 415
            assert loader.url_cache.stats.misses == 3
        finally:
            await loader.close()

    asyncio.run(run())
