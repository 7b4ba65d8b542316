"""What one request may bring and where its URLs may reach: the caps every stage that
takes media checks alike, from the stage's media flags (prism.config)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 * 1024 * 1024
    max_seconds: float = 600.0
    # Frames in the container (not the ones sampled): reading reaches past all of them.
    max_frames: int = 36_000
    # Per frame, as the image pixel cap.
    max_pixels: int = 3840 * 2160


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
