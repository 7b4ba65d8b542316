"""Request content: deterministic images, videos and audio, data URLs and chat messages."""

from __future__ import annotations

import base64
import io
import tempfile

import numpy as np
import PIL.Image


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A deterministic noise image, different for every seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    PIL.Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def video(
    seed: int,
    frames: int = 16,
    size: tuple[int, int] = (64, 48),
    fps: float = 8.0,
    container: str = "mp4",
) -> bytes:
    """A deterministic noise video (MPEG-4 in MP4, or VP8 in WebM), different for every seed."""
    from prism.media.video import encode_video

    rng = np.random.default_rng(seed)
    pixels = [rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) for _ in range(frames)]
    with tempfile.TemporaryDirectory() as directory:
        return encode_video(pixels, fps, f"{directory}/video.{container}")


def audio(seed: int, seconds: float = 1.0, rate: int = 16000, fmt: str = "WAV") -> bytes:
    """A deterministic noise clip (16-bit WAV, or another format soundfile writes),
    different for every seed."""
    import soundfile

    samples = np.random.default_rng(seed).uniform(-0.5, 0.5, int(seconds * rate))
    buffer = io.BytesIO()
    soundfile.write(buffer, samples.astype(np.float32), rate, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def input_audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}  # fmt: skip


def audio_part(url: str) -> dict:
    return {"type": "audio_url", "audio_url": {"url": url}}


def user(*parts: dict | str) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]
