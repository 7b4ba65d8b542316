"""Unit tests: video validation from the header, data URLs and fetching (loopback only)."""

import asyncio
import base64
from pathlib import Path

import cv2
import numpy as np
import pytest
from support.content import png, video
from support.meshes import ALLOWED_HOST

from prism.media.fetch import MediaLoader
from prism.media.policy import MediaPolicy, VideoLimits
from prism.media.video import VIDEO, VideoDecoder, check_video, encode_video
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError


@pytest.mark.parametrize("container,mime,codec", [("mp4", "video/mp4", "MPEG-4"),
                                                  ("webm", "video/webm", "VP8")])  # fmt: skip
def test_accepted_videos(container, mime, codec):
    checked = check_video(video(1, container=container), VideoLimits(), "v")
    assert (checked.mime_type, checked.codec) == (mime, codec)
    assert (checked.width, checked.height, checked.frames, checked.fps) == (64, 48, 16, 8.0)


def test_vp9_in_webm_is_accepted(tmp_path):
    path = str(tmp_path / "v.webm")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"VP90"), 8, (64, 48))
    assert writer.isOpened()
    for i in range(6):
        writer.write(np.full((48, 64, 3), 40 * i, np.uint8))
    writer.release()
    checked = check_video(Path(path).read_bytes(), VideoLimits(), "v")
    assert (checked.mime_type, checked.codec, checked.frames) == ("video/webm", "VP9", 6)


def _mjpeg_in_matroska(tmp_path) -> bytes:
    path = str(tmp_path / "v.mkv")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 8, (64, 48))
    for _ in range(4):
        writer.write(np.zeros((48, 64, 3), np.uint8))
    writer.release()
    return open(path, "rb").read()


def test_rejected_videos(tmp_path):
    whole = video(2)
    cases = {
        "empty": (b"", 400, "empty"),
        "text": (b"hello, this is not a video at all", 415, "not a video"),
        "image": (png(1), 415, "not a video"),
        "avi": (_avi(tmp_path), 415, "not a video"),
        "codec": (_mjpeg_in_matroska(tmp_path), 415, "unsupported video codec MJPG"),
        "truncated": (whole[: len(whole) // 2], 400, "cannot be opened"),
        "cut tail": (whole[:-100], 400, "cannot be decoded"),
    }
    for name, (data, status, message) in cases.items():
        with pytest.raises(PrismError) as info:
            check_video(data, VideoLimits(), "messages[0].content[1].video_url")
        assert info.value.http_status == status, name
        assert message in info.value.message, name
        assert info.value.param == "messages[0].content[1].video_url"


def _avi(tmp_path) -> bytes:
    path = str(tmp_path / "v.avi")
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"MJPG"), 8, (64, 48))
    writer.write(np.zeros((48, 64, 3), np.uint8))
    writer.release()
    return open(path, "rb").read()


@pytest.mark.parametrize(
    "limits,message",
    [
        (VideoLimits(max_bytes=1000), "bytes, more than the limit of 1000"),
        (VideoLimits(max_frames=15), "16 frames, more than the limit of 15"),
        (VideoLimits(max_seconds=1.5), "2.0 s long, more than the limit of 1.5 s"),
        (VideoLimits(max_pixels=64 * 48 - 1), "64x48 pixels a frame"),
    ],
    ids=["bytes", "frames", "seconds", "pixels"],
)
def test_caps_are_checked_from_the_header(limits, message):
    with pytest.raises(PrismError, match=message) as info:
        check_video(video(3), limits, "v")
    assert info.value.http_status == 400


def test_decoders_sample_as_vllm_loaders():
    data = video(4, frames=40)  # 5 s at 8 fps
    # vLLM's default loader: `frames` spread evenly.
    frames, metadata = VideoDecoder(None, frames=8).decode(data)
    assert frames.shape == (8, 48, 64, 3) and frames.dtype == np.uint8
    assert metadata["frames_indices"] == np.linspace(0, 39, 8, dtype=int).tolist()
    # Qwen2-VL's: 2 frames a second, an even count.
    frames, metadata = VideoDecoder("qwen2_vl").decode(data)
    assert metadata["frames_indices"] == [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]
    assert frames.shape == (10, 48, 64, 3)


def test_loader_takes_videos_from_data_urls_bytes_and_loopback(image_server):
    data = video(5, container="webm")
    url = image_server("/clip.webm", data, "video/webm")

    async def main():
        loader = MediaLoader(MediaPolicy(fetch_allow=(ALLOWED_HOST,)))
        try:
            inline = common_pb2.Video(
                url="data:video/webm;base64," + base64.b64encode(data).decode()
            )
            raw = common_pb2.Video(data=data, mime_type="video/webm")
            fetched = common_pb2.Video(url=url)
            for source in (inline, raw, fetched, fetched):
                assert (await loader.load(VIDEO, source, "v")).data == data
            # The data URL and the fetched one each checked once, the latter found again.
            assert (loader.url_cache.stats.hits, loader.url_cache.stats.misses) == (1, 2)
            with pytest.raises(PrismError) as info:
                await loader.load(VIDEO, common_pb2.Video(url="data:image/png;base64,AAAA"), "v")
            assert info.value.http_status == 415
            with pytest.raises(PrismError, match="video is larger than the limit"):
                small = MediaLoader(
                    MediaPolicy(fetch_allow=(ALLOWED_HOST,), video=VideoLimits(max_bytes=100))
                )
                try:
                    await small.load(VIDEO, common_pb2.Video(url=url), "v")
                finally:
                    await small.close()
        finally:
            await loader.close()

    asyncio.run(main())


def test_encode_video_round_trips(tmp_path):
    frames = [np.full((48, 64, 3), 40 * i, np.uint8) for i in range(4)]
    checked = check_video(encode_video(frames, 4.0, str(tmp_path / "v.webm")), VideoLimits(), "v")
    assert checked.frames == 4 and checked.fps == 4.0
