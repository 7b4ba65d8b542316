"""The pipeline: one request through the stages of the processor's mode. Images and videos
go to an encoder when the mode has one (image embeddings a client sent go past it); the
prompt goes to a worker, or, when decode is apart, to a prefill worker and then to a
decode worker that continues from prefill's KV cache.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator

import grpc

from prism import telemetry
from prism.kv_index import lay_out, prompt_keys
from prism.media.embeds import IMAGE_EMBEDS
from prism.media.modalities import MODALITIES
from prism.media.prompt import PromptMedia
from prism.modes import MeshRole, Mode
from prism.proto.stage.v1 import encoder_pb2, encoder_pb2_grpc, engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2, errors_pb2
from prism.routing import Router
from prism.rpc import multiplex
from prism.rpc.channel import call_metadata
from prism.rpc.errors import PrismError
from prism.runtime.clients import GENERATE, Peers
from prism.services.processor.cache_watch import CacheWatch
from prism.services.processor.encode_fallback import EncodeFallback
from prism.services.processor.failover import Failover, StageCalls
from prism.services.processor.inputs import ModelInputs

log = logging.getLogger(__name__)


class Pipeline:
    def __init__(
        self,
        mode: Mode,
        router: Router,
        inputs: ModelInputs | None = None,
        encoder_fallback: bool = True,
    ) -> None:
        self.mode = mode
        self.router = router
        self.inputs = inputs or ModelInputs()
        self.peers = Peers(router)
        self.failover = Failover(self.peers)
        self.fallback = EncodeFallback(router, encoder_fallback)
        # Releases of prefill KV still in flight (kept referenced until done).
        self._releases: set[asyncio.Task] = set()
        # `kv` routing: the prefix caches of the role that computes prompts.
        self._prompt_role = MeshRole.PREFILL if mode.disaggregated else MeshRole.WORKER
        self.cache_watch = (
            CacheWatch(self.peers, self._prompt_role) if router.policy == "kv" else None
        )

    async def ready(self) -> bool:
        """Probes every replica of every role of the mode (health, and load when routing
        by it), and follows the prefix caches of those that compute prompts when routing
        by them; True when each role has at least one serving replica, encoders aside
        where the workers encode in their stead."""
        if self.cache_watch is not None:
            self.cache_watch.refresh()
        ready = True
        for role in self.mode.roles:
            probes = [self.peers.probe(a) for a in self.router.registry.endpoints(role)]
            serving = any(await asyncio.gather(*probes))
            if role != MeshRole.ENCODER or not self.fallback.enabled:
                ready = serving and ready
        return ready

    async def close(self) -> None:
        for task in list(self._releases):
            await task
        if self.cache_watch is not None:
            await self.cache_watch.close()
        await self.peers.close()

    def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        media: PromptMedia,
        sampling: common_pb2.SamplingParams,
        call: StageCalls,
        migration_limit: int = 0,
        adapter: engine_pb2.LoraAdapter | None = None,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The worker replies of one request (with the LoRA `adapter`, if given); its stage
        calls go through `call`, so that an Abort can cancel them. If the worker streaming
        it dies, the request moves to another replica, up to `migration_limit` times."""

        async def attempt(
            engine_id: str, prompt: list[int], resumed: common_pb2.SamplingParams
        ) -> AsyncIterator[engine_pb2.GenerateResponse]:
            return await self._start(engine_id, prompt, media, resumed, call, adapter)

        return self.failover.migrating(
            attempt, request_id, prompt_ids, sampling, call, migration_limit
        )

    async def _start(
        self,
        request_id: str,
        prompt_ids: list[int],
        media: PromptMedia,
        sampling: common_pb2.SamplingParams,
        call: StageCalls,
        adapter: engine_pb2.LoraAdapter | None,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Encodes the media if the mode has an encoder (the worker encodes them where no
        encoder can: prism.services.processor.encode_fallback); then the worker replies."""
        request = engine_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling, adapter=adapter
        )
        if media.image_embeddings:
            # The processor admits no pixels beside them, and no videos without an encoder.
            IMAGE_EMBEDS.items(request.embeddings).extend(media.image_embeddings)
        embeddings = None
        if media.has_files and self.mode.has_encoder:
            embeddings = await self.fallback.encoded(
                lambda: self._encode(request_id, media, call), call
            )
        if embeddings is not None:
            for modality in MODALITIES:
                modality.items(request.embeddings).extend(modality.items(embeddings))
        elif media.has_files:
            for modality in MODALITIES:
                files = modality.items(request.files)
                files.extend(item.to_proto() for item in media.files(modality))
        keys = self._keys(prompt_ids, media, request.adapter.name)
        if self.mode.disaggregated:
            return self._prefill_then_decode(request, call, keys)
        return self._generate(MeshRole.WORKER, request, call, keys)

    async def _encode(
        self, request_id: str, media: PromptMedia, call: StageCalls
    ) -> encoder_pb2.MediaEmbeddings:
        """The embeddings of the request's images, videos and audios, in prompt order. Under `kv`
        routing each item goes to the encoder that owns its content hash, whose cache may
        hold it: items of several owners take a call to each, one after the other (a call
        at a time is what an Abort cancels). Otherwise one call encodes them all."""
        items = [(m, item) for m in MODALITIES for item in media.files(m)]
        by_content = self.router.policy == "kv"
        hashes = [m.content_hash(item.data) if by_content else "" for m, item in items]
        groups: dict[str, list[int]] = {}
        for index, digest in enumerate(hashes):
            owner = self.router.owner(MeshRole.ENCODER, digest) if by_content else ""
            groups.setdefault(owner, []).append(index)
        handles: list[encoder_pb2.EmbeddingHandle | None] = [None] * len(items)
        for indices in groups.values():
            encode = encoder_pb2.EncodeRequest(request_id=request_id)
            for index in indices:
                modality, item = items[index]
                modality.items(encode).append(item.to_proto())

            def encoded(address: str, encode=encode) -> grpc.aio.UnaryUnaryCall:
                stub = encoder_pb2_grpc.EncoderServiceStub(self.peers.channel(address))
                return stub.Encode(encode, metadata=call_metadata())

            async for reply in self.failover.on_replica(
                MeshRole.ENCODER, call, encoded, content=hashes[indices[0]]
            ):
                # Each modality's handles come in the order its items went.
                replies = {m.name: iter(m.items(reply.embeddings)) for m in MODALITIES}
                for index in indices:
                    handles[index] = next(replies[items[index][0].name])
        if len(groups) == 1:
            # A worker that cannot read them names no encoder: this one is then lost.
            call.holders[errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE] = call.address
        embeddings = encoder_pb2.MediaEmbeddings()
        for (modality, _), handle in zip(items, handles, strict=True):
            modality.items(embeddings).append(handle)
        return embeddings

    def _keys(self, prompt_ids: list[int], media: PromptMedia, adapter: str = "") -> list[int]:
        """The keys of the prompt's blocks that `kv` routing can know (under the LoRA
        `adapter`, "" for the base model): up to its first item whose tokens the processor
        cannot count."""
        if self.cache_watch is None or not self.router.block_size:
            return []
        tokens, spans = lay_out(
            prompt_ids, self.inputs.placeholders, self.inputs.media_items(media)
        )
        return prompt_keys(tokens, spans, self.router.block_size, adapter)

    def _generate(
        self,
        role: MeshRole,
        request: engine_pb2.GenerateRequest,
        call: StageCalls,
        keys: list[int] | None = None,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """`keys`: the prompt's block keys, for the role that computes prompts."""

        def start(address: str) -> multiplex.MultiplexCall:
            return self.peers.batched(address, GENERATE).call(request, call_metadata())

        blocks = 0
        if keys is not None and self.cache_watch is not None:
            blocks = -(-len(request.prompt_token_ids) // max(self.router.block_size, 1))
        # A decode that died may have read the prefill's KV, which prefill then freed: a
        # second decode could read reused blocks. The request migrates instead, prefilled
        # again.
        return self.failover.on_replica(
            role, call, start, retry_gone=role != MeshRole.DECODE, keys=keys or [], blocks=blocks,
            adapter=request.adapter.name,
        )  # fmt: skip

    async def _prefill_then_decode(
        self, request: engine_pb2.GenerateRequest, call: StageCalls, keys: list[int]
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Prefill computes the prompt's KV cache and the first token, which goes out at
        once; decode reads the cache and generates the rest."""
        if not request.sampling.HasField("seed"):
            # Both engines draw the first token; one seed makes them draw the same one.
            request.sampling.seed = secrets.randbits(63)
        first = engine_pb2.GenerateResponse()
        prompt = engine_pb2.PromptUsage()
        finish = engine_pb2.Finish()
        prefilled = False
        try:
            async for reply in self._generate(MeshRole.PREFILL, request, call, keys):
                first.token_ids.extend(reply.token_ids)
                first.logprobs.extend(reply.logprobs)
                if reply.HasField("first"):
                    prompt = reply.first
                if reply.HasField("last"):
                    finish = reply.last
            prefilled = True
        finally:
            if not prefilled and call.address:
                # Cut short (an abort, a cancel) after prefill may have finished: it then
                # holds the KV cache for a decode that this request will never send.
                self._release(call.address, request.request_id)
        prefill_address = call.address
        if not finish.HasField("kv_transfer_params"):
            raise PrismError(
                grpc.StatusCode.INTERNAL,
                f"prefill worker {prefill_address} returned no KV transfer parameters",
            )
        call.holders[errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED] = prefill_address
        # Until decode has read the KV cache, prefill holds it for this request.
        held = True
        try:
            first.first.CopyFrom(prompt)
            yield first
            if finish.reason == common_pb2.FINISH_REASON_STOP or (
                request.sampling.HasField("max_tokens") and request.sampling.max_tokens <= 1
            ):
                yield engine_pb2.GenerateResponse(last=engine_pb2.Finish(reason=finish.reason))
                return
            decode_request = engine_pb2.GenerateRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                kv_transfer_params=finish.kv_transfer_params,
                adapter=request.adapter if request.HasField("adapter") else None,
            )
            if finish.HasField("layouts"):
                decode_request.layouts.CopyFrom(finish.layouts)
            async for reply in self._generate(MeshRole.DECODE, decode_request, call):
                if held:
                    # Decode draws the first token again, from the same KV cache; the
                    # stream's first message was prefill's, with its logprobs.
                    held = False
                    drawn = len(first.token_ids)
                    again = list(reply.token_ids[:drawn])
                    if again != list(first.token_ids):
                        telemetry.FIRST_TOKEN_DIVERGENCES.inc()
                        log.warning(
                            "request %s: decode drew %s as the first token, prefill %s",
                            request.request_id, again, list(first.token_ids),
                        )  # fmt: skip
                    del reply.token_ids[:drawn]
                    del reply.logprobs[:drawn]
                    reply.ClearField("first")
                yield reply
        finally:
            if held:
                self._release(prefill_address, request.request_id)

    def _release(self, address: str, request_id: str) -> None:
        """Tells a prefill worker to free the KV cache it holds for a decode that won't
        come. In the background: the request may be unwinding from a cancellation."""

        async def release() -> None:
            try:
                await engine_pb2_grpc.EngineServiceStub(self.peers.channel(address)).Abort(
                    engine_pb2.EngineServiceAbortRequest(request_id=request_id),
                    timeout=10,
                    metadata=call_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("could not free the KV cache of %s on %s: %s", request_id, address,
                            exc.details())  # fmt: skip

        task = asyncio.create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
