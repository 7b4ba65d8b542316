"""The encoder stage: `EncoderService` runs the vision tower and projector in torch.

Embeddings are computed once per image or video (an LRU cache keyed by the model, the
bytes and, for a video, how its frames are sampled skips repeats) and published through
the stage's transfer (prism.transfer): with NIXL, copied into memory registered at
start-up and answered as descriptors that the worker pulls from, a slice freed when the
reader's notification arrives or when its lease runs out unread; inline, answered with
the bytes themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from prism import logs, rpc, telemetry
from prism.cache import ByteLru
from prism.media import MediaLoader, content_hash, decode_image, media_policy
from prism.modes import modes_served
from prism.rpc import invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.stage.v1 import encoder_pb2, encoder_pb2_grpc
from prism.tracing import tracer
from prism.transfer import Transfer, open_transfer
from prism.video import VideoDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embedding:
    """One item's embeddings and what the LLM needs besides them to place its tokens."""

    tensor: torch.Tensor
    grid_thw: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class VisionEncoder:
    """The family's own HF image and video processors and vision path (tower + projector).
    Videos are sampled by `videos` (as vLLM samples them for the model), where the model
    takes video at all."""

    def __init__(
        self, model: str, dtype: torch.dtype = torch.float32, videos: VideoDecoder | None = None
    ):
        self.config = AutoConfig.from_pretrained(model)
        processor = AutoProcessor.from_pretrained(model)
        self.image_processor = processor.image_processor
        self.video_processor = getattr(processor, "video_processor", None)
        self.videos = videos
        full = AutoModelForImageTextToText.from_pretrained(model, dtype=dtype)
        full.eval()
        self.model = full.model
        # The language model is never run here; drop its weights.
        self.model.language_model = None
        del full
        # torch runs one batch at a time on all cores; concurrent batches only contend.
        self._lock = threading.Lock()

    def _feature_kwargs(self) -> dict:
        if self.config.model_type == "llava":
            return {
                "vision_feature_layer": self.config.vision_feature_layer,
                "vision_feature_select_strategy": self.config.vision_feature_select_strategy,
            }
        return {}

    def encode(self, images: Sequence[bytes]) -> list[Embedding]:
        pixels = [decode_image(data) for data in images]
        inputs = self.image_processor(images=pixels, return_tensors="pt")
        grid = inputs.get("image_grid_thw")
        kwargs = self._feature_kwargs()
        if grid is not None:
            kwargs["image_grid_thw"] = grid
        with self._lock, torch.inference_mode():
            output = self.model.get_image_features(pixel_values=inputs["pixel_values"], **kwargs)
        return _embeddings(output.pooler_output, grid)

    def encode_videos(self, videos: Sequence[bytes]) -> list[Embedding]:
        if self.video_processor is None or self.videos is None:
            raise invalid("this model does not accept video", "videos")
        clips = [self.videos.decode(data)[0] for data in videos]
        inputs = self.video_processor(videos=clips, return_tensors="pt")
        grid = inputs["video_grid_thw"]
        with self._lock, torch.inference_mode():
            output = self.model.get_video_features(
                pixel_values_videos=inputs["pixel_values_videos"], video_grid_thw=grid
            )
        return _embeddings(output.pooler_output, grid)


def _embeddings(features: Sequence[torch.Tensor], grid: torch.Tensor | None) -> list[Embedding]:
    """One batch's features, split per item, with each item's grid."""
    return [
        Embedding(
            feature.contiguous(),
            tuple(int(v) for v in grid[i].tolist()) if grid is not None else (),
        )
        for i, feature in enumerate(features)
    ]


class EncoderServicer:
    """The handler of `EncoderService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        vision: VisionEncoder,
        agent: Transfer,
        loader: MediaLoader,
        cache: ByteLru[Embedding],
        lease_s: float,
        max_in_flight: int = 0,
    ):
        self.vision = vision
        self.agent = agent
        self.loader = loader
        self.cache = cache
        self.lease_s = lease_s
        self.limit = rpc.InFlightLimit(max_in_flight, "encode requests")
        self.service = Service(
            encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"],
            encoder_pb2_grpc,
            self.limit,
        )
        self.service.unary("Encode", self.encode, admit=True)

    def content_hash(self, modality: str, data: bytes) -> str:
        """The embedding cache key: what the item is and, for a video, how its frames are
        sampled."""
        if modality == "video" and self.vision.videos is not None:
            return content_hash(data, f"video {sorted(self.vision.videos.kwargs.items())}")
        return content_hash(data)

    def _encode_and_publish(
        self, request_id: str, modality: str, items: list[bytes]
    ) -> list[encoder_pb2.EmbeddingHandle]:
        keys = [self.content_hash(modality, data) for data in items]
        found = [self.cache.get(key) for key in keys]
        missing = [i for i, embedding in enumerate(found) if embedding is None]
        if missing:
            # One batch for every item of the request that the cache did not have.
            with tracer.start_as_current_span("vision.encode") as span:
                span.set_attributes({
                    "prism.request_id": logs.REQUEST_ID.get(), "prism.modality": modality,
                    "prism.items": len(missing),
                })  # fmt: skip
                encode = self.vision.encode if modality == "image" else self.vision.encode_videos
                fresh = encode([items[i] for i in missing])
            for i, embedding in zip(missing, fresh, strict=True):
                found[i] = embedding
                self.cache.put(keys[i], embedding)
        handles = []
        for i, (key, embedding) in enumerate(zip(keys, found, strict=True)):
            assert embedding is not None
            # Unique per publication: NIXL matches notifications by prefix.
            tag = f"{request_id}/{modality}/{i}/{uuid.uuid4().hex}"
            descriptor = self.agent.publish(embedding.tensor, tag, lease_s=self.lease_s)
            handles.append(
                encoder_pb2.EmbeddingHandle(
                    embeddings=descriptor,
                    content_hash=key,
                    grid_thw=embedding.grid_thw,
                    cached=i not in missing,
                )
            )
        return handles

    async def encode(self, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        if not request.images and not request.videos:
            raise invalid("images and videos must not both be empty", "images")
        policy = self.loader.policy
        if len(request.images) > policy.max_images:
            raise invalid(f"at most {policy.max_images} images per request", "images")
        if len(request.videos) > policy.max_videos:
            raise invalid(f"at most {policy.max_videos} videos per request", "videos")
        if request.videos and self.vision.video_processor is None:
            raise invalid("this model does not accept video", "videos")
        images, videos = await asyncio.gather(
            asyncio.gather(*(self.loader.load(image, f"images[{i}]")
                             for i, image in enumerate(request.images))),
            asyncio.gather(*(self.loader.load_video(video, f"videos[{i}]")
                             for i, video in enumerate(request.videos))),
        )  # fmt: skip
        request_id = request.request_id or uuid.uuid4().hex
        response = encoder_pb2.EncodeResponse()
        for modality, loaded, out in (
            ("image", images, response.embeddings.images),
            ("video", videos, response.embeddings.videos),
        ):
            if loaded:
                data = [item.data for item in loaded]
                out.extend(
                    await asyncio.to_thread(self._encode_and_publish, request_id, modality, data)
                )
        handles = [*response.embeddings.images, *response.embeddings.videos]
        log.info("encoded %d images and %d videos for %s (%d from the cache)", len(images),
                 len(videos), request_id, sum(h.cached for h in handles))  # fmt: skip
        return response


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


async def serve(args: argparse.Namespace) -> None:
    stage = Stage(args, "encoder")
    videos = VideoDecoder.for_model(args.model, args.video_frames, args.video_fps)
    vision = await asyncio.to_thread(VisionEncoder, args.model, videos=videos)
    agent = open_transfer(args.transfer, args.pool_mib * 2**20, args.lease_s)
    loader = MediaLoader(media_policy(args))
    cache: ByteLru[Embedding] = ByteLru(args.cache_mib * 2**20, size=lambda e: e.nbytes)
    servicer = EncoderServicer(vision, agent, loader, cache, args.lease_s, args.max_in_flight)
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
