"""Video validation and decoding, shared by every stage that takes videos.

A video arrives as container bytes, MP4 or WebM/Matroska. `check_video` reads its header
with vLLM's own OpenCV capture and holds it to the policy's caps before anything is decoded
but its first and last frame (which proves the stream is whole and its codec decodable).
`VideoDecoder` samples and decodes frames exactly as vLLM's chat API does for the model, so
that every mode sees the frames one vLLM engine would.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from prism.engine import media_io
from prism.media.modality import Files, Modality
from prism.media.policy import VideoLimits
from prism.proto.v1 import common_pb2
from prism.rpc.errors import check_size, invalid
from prism.rpc.errors import unsupported_media as unsupported

MIME_TYPES = ("video/mp4", "video/webm", "video/x-matroska", "video/quicktime")
# OpenCV's FourCC of each codec a maintained decoder handles (FFmpeg's, inside OpenCV):
# the tag an MP4 carries, or the one FFmpeg names the codec by in Matroska.
CODECS = {
    **dict.fromkeys(("avc1", "avc3", "h264", "x264"), "H.264"),
    **dict.fromkeys(("hvc1", "hev1", "hevc", "h265"), "HEVC"),
    **dict.fromkeys(("vp80", "vp08"), "VP8"),
    **dict.fromkeys(("vp90", "vp09"), "VP9"),
    **dict.fromkeys(("av01",), "AV1"),
    **dict.fromkeys(("fmp4", "mp4v", "xvid", "divx", "dx50"), "MPEG-4"),
}
_CODEC_NAMES = "H.264, HEVC, VP8, VP9, AV1 or MPEG-4"


@dataclass(frozen=True)
class LoadedVideo:
    data: bytes
    mime_type: str
    codec: str
    width: int
    height: int
    frames: int
    fps: float

    def to_proto(self) -> common_pb2.Video:
        return common_pb2.Video(data=self.data, mime_type=self.mime_type)

    def span_attributes(self) -> dict[str, Any]:
        return {"bytes": len(self.data), "mime_type": self.mime_type, "codec": self.codec,
                "width": self.width, "height": self.height, "frames": self.frames}  # fmt: skip


def container(data: bytes) -> str | None:
    """The container's MIME type from its first bytes, or None if it is none we take."""
    if data[4:8] == b"ftyp":
        return "video/quicktime" if data[8:12] == b"qt  " else "video/mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska, and WebM within it
        return "video/webm" if b"webm" in data[:64] else "video/x-matroska"
    return None


def _fourcc(code: float) -> str:
    value = int(code)
    return "".join(chr((value >> 8 * k) & 0xFF) for k in range(4)).strip("\0 ")


def check_video(data: bytes, limits: VideoLimits, param: str) -> LoadedVideo:
    """Checks container, codec, size, length and resolution of video bytes."""
    import cv2  # heavy: only the stages that take videos

    check_size(data, "video", limits.max_bytes, param)
    mime_type = container(data)
    if mime_type is None:
        raise unsupported("not a video: use MP4 or WebM", param)
    # Opened here, not by vLLM's OpenCV backend: the capture does not own its stream, and
    # releasing it after its BytesIO is gone crashes the process.
    stream = io.BytesIO(data)
    capture = cv2.VideoCapture(stream, media_io.opencv_video_api(), [])
    try:
        if not capture.isOpened():
            raise invalid("video cannot be opened: the file is damaged or incomplete", param)
        fourcc = _fourcc(capture.get(cv2.CAP_PROP_FOURCC))
        codec = CODECS.get(fourcc.lower())
        if codec is None:
            raise unsupported(
                f"unsupported video codec {fourcc or 'unknown'}: use {_CODEC_NAMES}", param
            )
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width * height > limits.max_pixels:
            raise invalid(
                f"video is {width}x{height} pixels a frame, more than the limit of "
                f"{limits.max_pixels}",
                param,
            )
        source = media_io.opencv_video_metadata(capture)
        frames, fps = source.total_frames_num, source.original_fps
        if frames <= 0 or fps <= 0:
            raise invalid("video has no frames or no known frame rate", param)
        if frames > limits.max_frames:
            raise invalid(
                f"video has {frames} frames, more than the limit of {limits.max_frames}", param
            )
        if source.duration > limits.max_seconds:
            raise invalid(
                f"video is {source.duration:.1f} s long, more than the limit of "
                f"{limits.max_seconds:g} s",
                param,
            )
        # The first and the last frame decode: the stream is whole and its codec works.
        for index in (0, frames - 1):
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            ok, _ = capture.read()
            if not ok:
                raise invalid(
                    f"video cannot be decoded: frame {index} of {frames} is unreadable", param
                )
    finally:
        capture.release()
    return LoadedVideo(data, mime_type, codec, width, height, frames, fps)


class VideoDecoder:
    """Frames of checked video bytes, sampled and decoded by vLLM's loader `backend` (its
    default when None: `frames` spread evenly); `fps` sets a rate-sampling loader's rate."""

    def __init__(self, backend: str | None = None, frames: int = 32, fps: float = 0.0) -> None:
        self.kwargs: dict[str, Any] = {"num_frames": frames}
        if fps > 0:
            self.kwargs["fps"] = fps
        if backend:
            self.kwargs["video_backend"] = backend

    @classmethod
    def for_model(cls, model: str, frames: int = 32, fps: float = 0.0) -> VideoDecoder:
        """Samples as vLLM's chat API does for `model`: with the loader its video processor
        asks for (Qwen2-VL's samples by frame rate), else vLLM's default."""
        return cls(media_io.video_loader_backend(model), frames, fps)

    def media_io_kwargs(self) -> dict[str, dict[str, Any]]:
        """The same sampling as vLLM's `media_io_kwargs` (for an engine of one's own)."""
        return {VIDEO.name: dict(self.kwargs)}

    def decode(self, data: bytes) -> tuple[Any, dict[str, Any]]:
        """(frames as a uint8 (N, H, W, 3) array, vLLM's metadata of them)."""
        return media_io.load_video(data, **self.kwargs)


VIDEO = Modality(
    name="video",
    part="video",
    field="videos",
    cap="max_videos",
    token_keys=("video_token_id",),
    files=Files(
        mime_types=MIME_TYPES,
        max_bytes=lambda policy: policy.video.max_bytes,
        check=lambda data, policy, param: check_video(data, policy.video, param),
        in_thread=True,
    ),
)


def encode_video(frames: list[Any], fps: float, path: str) -> bytes:
    """Encodes RGB uint8 frames with OpenCV's own encoder (MPEG-4 in MP4, VP8/VP9 in WebM,
    by `path`'s suffix): how tests and the bench make their videos."""
    import cv2

    height, width = frames[0].shape[:2]
    fourcc = {"mp4": "mp4v", "webm": "VP80", "mkv": "VP80"}[path.rsplit(".", 1)[-1]]
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {path}")
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    with open(path, "rb") as file:
        return file.read()
