"""The encoder stage: `EncoderService` runs the vision tower and projector in torch.

Embeddings are computed once per image (an LRU cache keyed by the model and the image
bytes skips repeats) and published through the stage's transfer (prism.transfer): with
NIXL, copied into memory registered at start-up and answered as descriptors that the
worker pulls from, a slice freed when the reader's notification arrives or when its lease
runs out unread; inline, answered with the bytes themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from prism import logs, rpc, telemetry
from prism.cache import ByteLru
from prism.media import LoadedImage, MediaLoader, MediaPolicy, decode_image
from prism.modes import modes_served
from prism.rpc import invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.stage.v1 import encoder_pb2, encoder_pb2_grpc
from prism.tracing import tracer
from prism.transfer import Transfer, open_transfer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Embedding:
    """One image's embeddings and what the LLM needs besides them to place its tokens."""

    tensor: torch.Tensor
    image_grid_thw: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class VisionEncoder:
    """The family's own HF image processor and vision path (tower + projector)."""

    def __init__(self, model: str, dtype: torch.dtype = torch.float32):
        self.config = AutoConfig.from_pretrained(model)
        self.image_processor = AutoProcessor.from_pretrained(model).image_processor
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
        features = output.pooler_output
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
        model_id: str,
        vision: VisionEncoder,
        agent: Transfer,
        loader: MediaLoader,
        cache: ByteLru[Embedding],
        lease_s: float,
        max_in_flight: int = 0,
    ):
        self.model_id = model_id
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

    def content_hash(self, image: LoadedImage) -> str:
        digest = hashlib.sha256(self.model_id.encode() + b"\0" + image.data)
        return digest.hexdigest()

    def _encode_and_publish(
        self, request_id: str, images: list[LoadedImage]
    ) -> list[encoder_pb2.EmbeddingHandle]:
        keys = [self.content_hash(image) for image in images]
        found = [self.cache.get(key) for key in keys]
        missing = [i for i, embedding in enumerate(found) if embedding is None]
        if missing:
            # One batch for every image of the request that the cache did not have.
            with tracer.start_as_current_span("vision.encode") as span:
                span.set_attributes({
                    "prism.request_id": logs.REQUEST_ID.get(), "prism.images": len(missing),
                })  # fmt: skip
                fresh = self.vision.encode([images[i].data for i in missing])
            for i, embedding in zip(missing, fresh, strict=True):
                found[i] = embedding
                self.cache.put(keys[i], embedding)
        handles = []
        for i, (key, embedding) in enumerate(zip(keys, found, strict=True)):
            assert embedding is not None
            # Unique per publication: NIXL matches notifications by prefix.
            tag = f"{request_id}/{i}/{uuid.uuid4().hex}"
            descriptor = self.agent.publish(embedding.tensor, tag, lease_s=self.lease_s)
            handles.append(
                encoder_pb2.EmbeddingHandle(
                    embeddings=descriptor,
                    content_hash=key,
                    image_grid_thw=embedding.image_grid_thw,
                    cached=i not in missing,
                )
            )
        return handles

    async def encode(self, request: encoder_pb2.EncodeRequest) -> encoder_pb2.EncodeResponse:
        if not request.images:
            raise invalid("images must not be empty", "images")
        limit = self.loader.policy.max_images
        if len(request.images) > limit:
            raise invalid(f"at most {limit} images per request", "images")
        images = await asyncio.gather(
            *(self.loader.load(image, f"images[{i}]") for i, image in enumerate(request.images))
        )
        request_id = request.request_id or uuid.uuid4().hex
        handles = await asyncio.to_thread(self._encode_and_publish, request_id, images)
        cached = sum(handle.cached for handle in handles)
        log.info("encoded %d images for %s (%d from the cache)", len(handles), request_id, cached)
        return encoder_pb2.EncodeResponse(handles=handles)


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
    vision = await asyncio.to_thread(VisionEncoder, args.model)
    agent = open_transfer(args.transfer, args.pool_mib * 2**20, args.lease_s)
    loader = MediaLoader(
        MediaPolicy(max_images=args.max_images, fetch_allow=tuple(args.fetch_allow))
    )
    cache: ByteLru[Embedding] = ByteLru(args.cache_mib * 2**20, size=lambda e: e.nbytes)
    servicer = EncoderServicer(
        args.model, vision, agent, loader, cache, args.lease_s, args.max_in_flight
    )
    collectors = [
        telemetry.transfer_collector(agent),
        telemetry.cache_collector("prism_embedding_cache", "Embedding", cache.stats),
        telemetry.cache_collector("prism_image_cache", "Image URL", loader.url_cache.stats),
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
