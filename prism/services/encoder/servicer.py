"""`EncoderService`'s handler: loads a request's images and videos, encodes each item once
(batched with other requests' items, cached by content) and publishes the embeddings
through the stage's transfer for the worker to read."""

from __future__ import annotations

import asyncio
import logging
import uuid

from prism import logs, telemetry
from prism.cache import ByteLru
from prism.media.fetch import MediaLoader
from prism.media.modalities import MODALITIES
from prism.media.modality import Modality
from prism.proto.stage.v1 import encoder_pb2, encoder_pb2_grpc
from prism.rpc.errors import invalid
from prism.rpc.server import InFlightLimit
from prism.runtime.service import Service
from prism.services.encoder.batching import Batcher
from prism.services.encoder.towers import Embedding, MediaEncoder
from prism.tracing import tracer
from prism.transfer import Transfer

# The stage's logger: its request lines read as the encoder's, as the processor's do.
log = logging.getLogger(__package__)


class EncoderServicer:
    """The handler of `EncoderService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        vision: MediaEncoder,
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
            for modality, encode in vision.encoders.items()
        }

    def content_hash(self, modality: Modality, data: bytes) -> str:
        """The embedding cache key: what the item is and, for a video, how its frames are
        sampled."""
        return modality.content_hash(data, self.vision.sampling(modality))

    async def _embed(
        self, modality: Modality, items: list[bytes]
    ) -> list[tuple[str, Embedding, bool]]:
        """Each item's cache key, embeddings, and whether the cache had them."""
        keys = await asyncio.to_thread(lambda: [self.content_hash(modality, d) for d in items])
        found = {i: hit for i, key in enumerate(keys) if (hit := self.cache.get(key)) is not None}
        missing = [i for i in range(len(keys)) if i not in found]
        fresh: dict[int, Embedding] = {}
        if missing:
            # The request's share of the batches its items join.
            with tracer.start_as_current_span("vision.encode") as span:
                span.set_attributes({
                    "prism.request_id": logs.REQUEST_ID.get(), "prism.modality": modality.name,
                    "prism.items": len(missing),
                })  # fmt: skip
                submit = self.batchers[modality.name].submit
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
        fields = [modality.field for modality in MODALITIES]
        if not any(modality.items(request) for modality in MODALITIES):
            raise invalid(f"{' and '.join(fields)} must not both be empty", fields[0])
        policy = self.loader.policy
        for modality in MODALITIES:
            count, field = len(modality.items(request)), modality.field
            if count > modality.limit(policy):
                raise invalid(f"at most {modality.limit(policy)} {field} per request", field)
            if count and not self.vision.takes(modality):
                raise invalid(f"this model does not accept {modality.name}", field)
        loaded = await asyncio.gather(*(
            asyncio.gather(*(self.loader.load(m, item, f"{m.field}[{i}]")
                             for i, item in enumerate(m.items(request))))
            for m in MODALITIES
        ))  # fmt: skip
        request_id = request.request_id or uuid.uuid4().hex
        response = encoder_pb2.EncodeResponse()
        for modality, items in zip(MODALITIES, loaded, strict=True):
            if items:
                embedded = await self._embed(modality, [item.data for item in items])
                published = await asyncio.to_thread(
                    self._publish, request_id, modality.name, embedded
                )
                modality.items(response.embeddings).extend(published)
        handles = [h for modality in MODALITIES for h in modality.items(response.embeddings)]
        counted = " and ".join(
            f"{len(items)} {m.field}" for m, items in zip(MODALITIES, loaded, strict=True)
        )
        log.info("encoded %s for %s (%d from the cache)", counted, request_id,
                 sum(h.cached for h in handles))  # fmt: skip
        return response
