"""What one request may bring and where its URLs may reach: the caps every stage that
takes media checks alike, from the stage's media flags (prism.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prism.config.common import FetchConfig, MediaConfig


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 * 1024 * 1024
    max_seconds: float = 600.0
    # Frames in the container (not the ones sampled): reading reaches past all of them.
    max_frames: int = 36_000
    # Per frame, as the image pixel cap.
    max_pixels: int = 3840 * 2160


@dataclass(frozen=True)
class AudioLimits:
    # OpenAI's and vLLM's cap on an audio file.
    max_bytes: int = 25 * 1024 * 1024
    max_seconds: float = 600.0
    # Studio rates reach 192 kHz; more is no recording a model hears.
    max_sample_rate: int = 192_000
    max_channels: int = 8


@dataclass(frozen=True)
class MediaPolicy:
    max_image_bytes: int = 20 * 1024 * 1024
    # Guards against decompression bombs: checked from the header, before decoding.
    max_image_pixels: int = 40_000_000
    max_images: int = 8
    max_videos: int = 4
    max_audios: int = 4
    video: VideoLimits = field(default_factory=VideoLimits)
    audio: AudioLimits = field(default_factory=AudioLimits)
    connect_timeout_s: float = 5.0
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # Host names or networks (CIDR) that URLs may reach although they are not public.
    fetch_allow: tuple[str, ...] = ()
    # Media fetched from http(s) URLs are kept this long (bytes) for repeated requests.
    url_cache_bytes: int = 64 * 1024 * 1024


def media_policy(media: MediaConfig, fetch: FetchConfig) -> MediaPolicy:
    """The policy a stage's media and fetch flags ask for."""
    return MediaPolicy(
        max_images=media.max_images,
        max_videos=media.max_videos,
        video=VideoLimits(
            max_bytes=media.max_video_mib * 2**20,
            max_seconds=media.max_video_seconds,
            max_frames=media.max_video_frames,
            max_pixels=media.max_video_pixels,
        ),
        max_audios=media.max_audios,
        audio=AudioLimits(
            max_bytes=media.max_audio_mib * 2**20, max_seconds=media.max_audio_seconds
        ),
        fetch_allow=tuple(fetch.fetch_allow),
    )
