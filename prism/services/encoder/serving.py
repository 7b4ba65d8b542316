"""The encoder stage as a process: `serve` loads the vision path, opens the transfer the
embeddings are published through and serves `EncoderServicer` on the stage runtime, with
a task that frees what readers have read."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from prism import telemetry
from prism.cache import ByteLru
from prism.media.fetch import MediaLoader
from prism.media.policy import media_policy
from prism.media.video import VideoDecoder
from prism.modes import modes_served
from prism.runtime.stage import Stage
from prism.services.encoder.servicer import EncoderServicer
from prism.services.encoder.towers import Embedding, MediaEncoder
from prism.transfer import Transfer, open_transfer

if TYPE_CHECKING:
    from prism.config.commands import EncoderStageConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _release_read_embeddings(
    agent: Transfer, period: float = 0.02, idle_period: float = 0.5
) -> None:
    """Frees slices whose readers have notified, and reclaims expired leases.

    With nothing published there is nothing to free: an idle encoder looks less often (a
    full pool is freed by `publish` itself)."""
    while True:
        if agent.pool_bytes_in_use:
            await asyncio.to_thread(agent.poll)
            await asyncio.sleep(period)
        else:
            await asyncio.sleep(idle_period)


def _slowed(
    encode: Callable[[Sequence[bytes]], T], per_item_s: float
) -> Callable[[Sequence[bytes]], T]:
    """`encode`, holding its thread `per_item_s` longer per item: the batcher runs one pass
    at a time, so the encoder is busy as a device running a larger tower would be."""

    def run(items: Sequence[bytes]) -> T:
        time.sleep(per_item_s * len(items))
        return encode(items)

    return run


async def serve(config: EncoderStageConfig) -> None:
    own, model, media = config.encoder, config.model.model, config.media
    stage = Stage(config, "encoder")
    videos = VideoDecoder.for_model(model, media.video_frames, media.video_fps)
    vision = await asyncio.to_thread(MediaEncoder, model, own.device, own.dtype, videos=videos)
    log.info("vision path on %s in %s", vision.device, vision.dtype)
    if config.sim_encoder.sim_encode_ms:
        per_item = config.sim_encoder.sim_encode_ms / 1000
        vision.encoders = {
            name: _slowed(encode, per_item) for name, encode in vision.encoders.items()
        }
    agent = open_transfer(
        config.transfer.transfer, own.pool_mib * 2**20, own.lease_s, device=vision.device
    )
    loader = MediaLoader(media_policy(media, config.fetch))
    cache: ByteLru[Embedding] = ByteLru(own.cache_mib * 2**20, size=lambda e: e.nbytes)
    servicer = EncoderServicer(
        vision,
        agent,
        loader,
        cache,
        own.lease_s,
        config.limit.max_in_flight,
        batch_size=own.batch_size,
        batch_wait_s=own.batch_wait_ms / 1000,
    )
    collectors = [
        telemetry.transfer_collector(agent),
        telemetry.cache_collector("prism_embedding_cache", "Embedding", cache.stats),
        telemetry.cache_collector(
            "prism_image_cache", "Image and video URL", loader.url_cache.stats
        ),
    ]
    try:
        await stage.serve(
            [servicer.service],
            modes_served(),
            collectors,
            in_flight=lambda: servicer.limit.count,
            tasks=[lambda _: _release_read_embeddings(agent)],
        )
    finally:
        await loader.close()
        agent.close()
