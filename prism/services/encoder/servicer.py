"""`EncoderService`'s handler: loads a request's images and videos, encodes each item once
(batched with other requests' items, cached by content) and publishes the embeddings
through the stage's transfer for the worker to read."""

from __future__ import annotations

import asyncio
import logging
import uuid

from prism import logs, telemetry
from prism.cache import ByteLru
from prism.media import MediaLoader, content_hash
from prism.rpc.errors import invalid
from prism.rpc.server import InFlightLimit
from prism.runtime.service import Service
from prism.services.encoder.batching import Batcher
from prism.services.encoder.vision import Embedding, VisionEncoder
from prism.stage.v1 import encoder_pb2, encoder_pb2_grpc
from prism.tracing import tracer
from prism.transfer import Transfer

# The stage's logger: its request lines read as the encoder's, as the processor's do.
log = logging.getLogger(__package__)


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
        batch_size: int = 32,
        batch_wait_s: float = 0.002,
    ):
        self.vision = vision
        self.agent = agent
        self.loader = loader
        self.cache = cache
        self.lease_s = lease_s
        self.limit = InFlightLimit(max_in_flight, "encode requests")
        self.service = Service(
            encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"],
            encoder_pb2_grpc,
            self.limit,
        )
        self.service.unary("Encode", self.encode, admit=True)
        self.batchers = {
            modality: Batcher(
                encode,
                batch_size,
                batch_wait_s,
                on_batch=telemetry.ENCODER_BATCH_ITEMS.labels(modality).observe,
                on_result=self.cache.put,
            )
            for modality, encode in (("image", vision.encode), ("video", vision.encode_videos))
        }

    def content_hash(self, modality: str, data: bytes) -> str:
        """The embedding cache key: what the item is and, for a video, how its frames are
        sampled."""
        if modality == "video" and self.vision.videos is not None:
            return content_hash(data, f"video {sorted(self.vision.videos.kwargs.items())}")
        return content_hash(data)

    async def _embed(self, modality: str, items: list[bytes]) -> list[tuple[str, Embedding, bool]]:
        """Each item's cache key, embeddings, and whether the cache had them."""
        keys = await asyncio.to_thread(lambda: [self.content_hash(modality, d) for d in items])
        found = {i: hit for i, key in enumerate(keys) if (hit := self.cache.get(key)) is not None}
        missing = [i for i in range(len(keys)) if i not in found]
        fresh: dict[int, Embedding] = {}
        if missing:
            # The request's share of the batches its items join.
            with tracer.start_as_current_span("vision.encode") as span:
                span.set_attributes({
                    "prism.request_id": logs.REQUEST_ID.get(), "prism.modality": modality,
                    "prism.items": len(missing),
                })  # fmt: skip
                submit = self.batchers[modality].submit
                encoded = await asyncio.gather(*(submit(keys[i], items[i]) for i in missing))
            fresh = dict(zip(missing, encoded, strict=True))
        return [
            (key, found[i] if i in found else fresh[i], i in found) for i, key in enumerate(keys)
        ]

    def _publish(
        self, request_id: str, modality: str, embedded: list[tuple[str, Embedding, bool]]
    ) -> list[encoder_pb2.EmbeddingHandle]:
        handles = []
        for i, (key, embedding, cached) in enumerate(embedded):
            # Unique per publication: NIXL matches notifications by prefix.
            tag = f"{request_id}/{modality}/{i}/{uuid.uuid4().hex}"
            descriptor = self.agent.publish(embedding.tensor, tag, lease_s=self.lease_s)
            handles.append(
                encoder_pb2.EmbeddingHandle(
                    embeddings=descriptor,
                    content_hash=key,
                    grid_thw=embedding.grid_thw,
                    cached=cached,
                    second_per_grid_ts=embedding.second_per_grid_ts,
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
                embedded = await self._embed(modality, [item.data for item in loaded])
                out.extend(await asyncio.to_thread(self._publish, request_id, modality, embedded))
        handles = [*response.embeddings.images, *response.embeddings.videos]
        log.info("encoded %d images and %d videos for %s (%d from the cache)", len(images),
                 len(videos), request_id, sum(h.cached for h in handles))  # fmt: skip
        return response
