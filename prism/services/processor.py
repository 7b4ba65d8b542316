"""The processor stage: the public `InferenceService`.

It applies the model's chat template, tokenizes, loads and validates images, runs the
pipeline of its mode, and turns the token ids that come back into text deltas with
vLLM's own incremental detokenizer (so text and stop strings match plain vLLM exactly).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from opentelemetry import trace
from transformers import AutoTokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

from prism import logs, rpc, telemetry
from prism.media import ImageLoader, LoadedImage, MediaPolicy
from prism.modes import MeshRole, Mode, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc import PrismError, invalid, multiplex
from prism.rpc.service import Service
from prism.rpc.stage import Stage
from prism.sampling import to_vllm
from prism.v1 import (
    common_pb2,
    encoder_pb2,
    encoder_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    errors_pb2,
    inference_pb2,
    inference_pb2_grpc,
    load_pb2,
    load_pb2_grpc,
)

log = logging.getLogger(__name__)

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name

_ROLE_NAMES = {
    inference_pb2.ROLE_SYSTEM: "system",
    inference_pb2.ROLE_USER: "user",
    inference_pb2.ROLE_ASSISTANT: "assistant",
    # OpenAI's developer role plays the system role for models that know no other.
    inference_pb2.ROLE_DEVELOPER: "system",
}


Response = TypeVar("Response", inference_pb2.ChatResponse, inference_pb2.CompleteResponse)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None


@dataclass
class _DetokenizerRequest:
    """The fields of vLLM's EngineCoreRequest that its detokenizer reads."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: object
    prompt_embeds: None = None


CallT = TypeVar("CallT", bound=grpc.aio.Call | multiplex.Call)


@dataclass
class Call:
    """The stage call a request is waiting on, so that an Abort can cancel it."""

    current: grpc.aio.Call | multiplex.Call | None = None
    # The replica `current` went to.
    address: str = ""
    aborted: bool = False

    def track(self, call: CallT, address: str = "") -> CallT:
        self.current = call
        self.address = address
        if self.aborted:
            call.cancel()
        return call

    def abort(self) -> None:
        self.aborted = True
        if self.current is not None:
            self.current.cancel()


# How long a call waits for its replica's channel to connect.
_CONNECT_S = 3.0


# A worker could not read what another replica held for the request (prefill's KV, an
# encoder's embeddings): that replica is lost, not the worker, and so is its data for every
# worker. The request runs again from the stage that lost it.
_UPSTREAM_LOST = (
    errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
    errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE,
)


def _replica_gone(exc: grpc.aio.AioRpcError) -> bool:
    """The replica is down or draining (not the one whose data it could not read)."""
    return (
        exc.code() == grpc.StatusCode.UNAVAILABLE
        and PrismError.from_rpc_error(exc).reason not in _UPSTREAM_LOST
    )


def _upstream_lost(exc: grpc.aio.AioRpcError) -> bool:
    return PrismError.from_rpc_error(exc).reason in _UPSTREAM_LOST


def _replica_full(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass
class Pipeline:
    """Runs one request through the stages of a mode; yields the worker replies."""

    mode: Mode
    router: Router
    _channels: dict[str, grpc.aio.Channel] = field(default_factory=dict)
    # Per worker: the one stream that carries every Generate call to it.
    _batches: dict[str, multiplex.Client] = field(default_factory=dict)
    # Releases of prefill KV still in flight (kept referenced until done).
    _releases: set[asyncio.Task] = field(default_factory=set)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = rpc.channel(address)
        return self._channels[address]

    def _engine(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        return engine_pb2_grpc.EngineServiceStub(self._channel(address))

    def _batched(self, address: str) -> multiplex.Client:
        if address not in self._batches:
            self._batches[address] = multiplex.Client(
                self._engine(address).GenerateBatch, engine_pb2.GenerateBatchRequest
            )
        return self._batches[address]

    async def _probe(self, address: str) -> bool:
        channel = self._channel(address)
        probed_at = time.monotonic()
        serving = await rpc.is_serving(channel)
        in_flight = None
        if serving and self.router.policy == "least-loaded":
            try:
                load = await load_pb2_grpc.LoadServiceStub(channel).GetLoad(
                    load_pb2.GetLoadRequest(), timeout=1.0
                )
                in_flight = load.in_flight
            except grpc.aio.AioRpcError:
                pass  # e.g. a sidecar's upstream that balances by itself
        self.router.report(address, serving, in_flight, probed_at)
        return serving

    async def ready(self) -> bool:
        """Probes every replica of every role of the mode (health, and load when routing
        by it); True when each role has at least one serving replica."""
        ready = True
        for role in self.mode.roles:
            probes = [self._probe(a) for a in self.router.registry.endpoints(role)]
            ready = any(await asyncio.gather(*probes)) and ready
        return ready

    async def close(self) -> None:
        for task in list(self._releases):
            await task
        for batched in self._batches.values():
            await batched.close()
        for channel in self._channels.values():
            await channel.close()

    async def _on_replica(
        self,
        role: MeshRole,
        call: Call,
        start: Callable[[str], grpc.aio.Call | multiplex.Call],
        retry_gone: bool = True,
    ) -> AsyncIterator:
        """The replies of the call `start(address)` makes to a replica of `role` (one for a
        unary call). If the replica turns out to be full, or gone (with `retry_gone`),
        before its first reply, tries once more on another one."""
        tried: list[str] = []
        while True:
            address = self.router.pick(role, exclude=tried)
            channel = self._channel(address)
            if channel.get_state(try_to_connect=True) != grpc.ChannelConnectivity.READY:
                # A replica that came up (or back) moments ago may still be in its channel's
                # reconnect backoff, where a call fails at once with the last connect error
                # (a refusal from before it listened): give it a moment to connect.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(channel.channel_ready(), _CONNECT_S)
            replied = False
            try:
                with self.router.using(address):
                    stage_call = call.track(start(address), address)
                    try:
                        if isinstance(stage_call, grpc.aio.UnaryUnaryCall):
                            yield await stage_call
                        else:
                            async for reply in stage_call:
                                replied = True
                                yield reply
                    finally:
                        # A request that ends early (stop string, abort, error elsewhere)
                        # leaves the call open: end it here, not whenever it is collected.
                        stage_call.cancel()
                return
            except grpc.aio.AioRpcError as exc:
                # Another replica may do what this one could not, if nothing was sent yet.
                gone = _replica_gone(exc)
                if gone:
                    self.router.mark_down(address)
                if (
                    replied
                    or tried
                    or call.aborted
                    or not ((gone and retry_gone) or _replica_full(exc))
                ):
                    raise
                tried.append(address)
                if not [a for a in self.router.registry.endpoints(role) if a not in tried]:
                    raise
                log.warning(
                    "%s %s unavailable (%s); trying another replica", role, address, exc.details()
                )

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        images: list[LoadedImage],
        sampling: common_pb2.SamplingParams,
        call: Call,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Runs the stages of the mode; stage calls go through `call` so they can be aborted."""
        request = engine_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling
        )
        images_pb = [image.to_proto() for image in images]
        encoder = ""
        if images_pb and self.mode.has_encoder:
            encode = encoder_pb2.EncodeRequest(request_id=request_id, images=images_pb)

            def encoded(address: str) -> grpc.aio.UnaryUnaryCall:
                stub = encoder_pb2_grpc.EncoderServiceStub(self._channel(address))
                return stub.Encode(encode, metadata=rpc.call_metadata())

            async for reply in self._on_replica(MeshRole.ENCODER, call, encoded):
                request.image_embeddings.extend(reply.handles)
            encoder = call.address
        else:
            request.images.extend(images_pb)
        if self.mode.disaggregated:
            replies = self._prefill_then_decode(request, call)
        else:
            replies = self._generate(MeshRole.WORKER, request, call)
        try:
            async for reply in replies:
                yield reply
        except grpc.aio.AioRpcError as exc:
            if encoder:
                self._blame(exc, errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE, encoder)
            raise

    def _blame(
        self, exc: grpc.aio.AioRpcError, reason: errors_pb2.ErrorReason, holder: str
    ) -> None:
        """A worker's call failed with `exc`: if for `reason` (it could not read what the
        replica at `holder` held for it), that replica is marked down, so that the request,
        run again, goes elsewhere."""
        if PrismError.from_rpc_error(exc).reason == reason:
            self.router.mark_down(holder)

    async def run_migrating(
        self,
        request_id: str,
        prompt_ids: list[int],
        images: list[LoadedImage],
        sampling: common_pb2.SamplingParams,
        call: Call,
        limit: int,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """`run`, moved to another replica up to `limit` times if the worker streaming it
        dies: the new one continues from the prompt plus the tokens already streamed."""
        emitted: list[int] = []
        for attempt in range(limit + 1):
            if sampling.HasField("max_tokens") and len(emitted) >= sampling.max_tokens:
                # The worker died between its last token and its last reply.
                yield engine_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
                return
            resumed = common_pb2.SamplingParams()
            resumed.CopyFrom(sampling)
            if sampling.HasField("max_tokens"):
                resumed.max_tokens = sampling.max_tokens - len(emitted)
            resumed.min_tokens = max(0, sampling.min_tokens - len(emitted))
            # A new engine request id: the old one may linger in a prefill's connector.
            engine_id = f"{request_id}-migrated-{attempt}" if attempt else request_id
            try:
                async for reply in self.run(engine_id, prompt_ids + emitted, images, resumed, call):
                    if attempt:
                        # Usage counts the client's prompt, not the one resumed from.
                        reply.prompt_tokens = reply.cached_tokens = 0
                    emitted += reply.token_ids
                    yield reply
                return
            except grpc.aio.AioRpcError as exc:
                # A replica lost before the first token was tried again already
                # (_on_replica), unless the data a worker was to read went with it.
                lost = (emitted and _replica_gone(exc)) or _upstream_lost(exc)
                if attempt == limit or call.aborted or not lost:
                    raise
                log.warning(
                    "request %s lost a replica after %d tokens (%s); resuming elsewhere",
                    request_id, len(emitted), exc.details(),
                )  # fmt: skip

    def _generate(
        self, role: MeshRole, request: engine_pb2.GenerateRequest, call: Call
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        def start(address: str) -> multiplex.Call:
            return self._batched(address).call(request, rpc.call_metadata())

        # A decode that died may have read the prefill's KV, which prefill then freed: a
        # second decode could read reused blocks. The request migrates instead, prefilled
        # again (run_migrating).
        return self._on_replica(role, call, start, retry_gone=role != MeshRole.DECODE)

    async def _prefill_then_decode(
        self, request: engine_pb2.GenerateRequest, call: Call
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """Prefill computes the prompt's KV cache and the first token, which goes out at
        once; decode reads the cache and generates the rest."""
        if not request.sampling.HasField("seed"):
            # Both engines draw the first token; one seed makes them draw the same one.
            request.sampling.seed = secrets.randbits(63)
        prefilled = engine_pb2.GenerateResponse()
        async for reply in self._generate(MeshRole.PREFILL, request, call):
            prefilled.MergeFrom(reply)
        prefill_address = call.address
        if not prefilled.HasField("kv_transfer_params"):
            raise PrismError(
                grpc.StatusCode.INTERNAL,
                f"prefill worker {prefill_address} returned no KV transfer parameters",
            )
        # Until decode has read the KV cache, prefill holds it for this request.
        held = True
        try:
            first = list(prefilled.token_ids)
            finished = prefilled.finish_reason == common_pb2.FINISH_REASON_STOP or (
                request.sampling.HasField("max_tokens") and request.sampling.max_tokens <= 1
            )
            yield engine_pb2.GenerateResponse(
                token_ids=first,
                prompt_tokens=prefilled.prompt_tokens,
                cached_tokens=prefilled.cached_tokens,
                finish_reason=(
                    prefilled.finish_reason if finished else common_pb2.FINISH_REASON_UNSPECIFIED
                ),
            )
            if finished:
                return
            decode_request = engine_pb2.GenerateRequest(
                request_id=request.request_id,
                prompt_token_ids=request.prompt_token_ids,
                sampling=request.sampling,
                kv_transfer_params=prefilled.kv_transfer_params,
                image_layouts=prefilled.image_layouts,
            )
            async for reply in self._generate(MeshRole.DECODE, decode_request, call):
                if held:
                    # Decode draws the first token again, from the same KV cache.
                    held = False
                    again = reply.token_ids[: len(first)]
                    if list(again) != first:
                        log.warning(
                            "request %s: decode drew %s as the first token, prefill %s",
                            request.request_id, list(again), first,
                        )  # fmt: skip
                    del reply.token_ids[: len(first)]
                    reply.prompt_tokens = 0
                yield reply
        except grpc.aio.AioRpcError as exc:
            self._blame(exc, errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED, prefill_address)
            raise
        finally:
            if held:
                self._release(prefill_address, request.request_id)

    def _release(self, address: str, request_id: str) -> None:
        """Tells a prefill worker to free the KV cache it holds for a decode that won't
        come. In the background: the request may be unwinding from a cancellation."""

        async def release() -> None:
            try:
                await self._engine(address).Abort(
                    engine_pb2.EngineServiceAbortRequest(request_id=request_id),
                    timeout=10,
                    metadata=rpc.call_metadata(),
                )
            except grpc.aio.AioRpcError as exc:
                log.warning("could not free the KV cache of %s on %s: %s", request_id, address,
                            exc.details())  # fmt: skip

        task = asyncio.create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


class InferenceServicer:
    """The handlers of `InferenceService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        model: str,
        served_model_name: str,
        pipeline: Pipeline,
        loader: ImageLoader,
        max_model_len: int,
        max_in_flight: int = 0,
        migration_limit: int = 1,
    ):
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.migration_limit = migration_limit
        self.served_model_name = served_model_name
        self.pipeline = pipeline
        self.loader = loader
        self.max_model_len = max_model_len
        self.created = int(time.time())
        self._active: dict[str, Call] = {}
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
            rpc.InFlightLimit(max_in_flight),
        )
        self.service.stream("Chat", self.chat, timed=True)
        self.service.stream("Complete", self.complete, timed=True)
        self.service.unary("ListModels", self.list_models)
        self.service.unary("Abort", self.abort)

    def _check_model(self, model: str) -> None:
        if model and model != self.served_model_name:
            raise PrismError(
                grpc.StatusCode.NOT_FOUND,
                f"The model `{model}` does not exist.",
                reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
                param="model",
            )

    def _conversation(
        self, messages: list[inference_pb2.ChatMessage]
    ) -> tuple[list[dict], list[tuple[common_pb2.Image, str]]]:
        if not messages:
            raise invalid("messages must not be empty", "messages")
        conversation, images = [], []
        for i, message in enumerate(messages):
            role = _ROLE_NAMES.get(message.role)
            if role is None:
                raise invalid(f"messages[{i}].role is missing or unknown", f"messages[{i}].role")
            parts: list[dict] = []
            for j, part in enumerate(message.content):
                kind = part.WhichOneof("part")
                if kind == "text":
                    parts.append({"type": "text", "text": part.text})
                elif kind == "image":
                    if role != "user":
                        raise invalid(
                            "images are allowed in user messages only",
                            f"messages[{i}].content[{j}]",
                        )
                    parts.append({"type": "image"})
                    images.append((part.image, f"messages[{i}].content[{j}].image_url"))
                else:
                    raise invalid("content part is empty", f"messages[{i}].content[{j}]")
            conversation.append({"role": role, "content": parts})
        limit = self.loader.policy.max_images
        if len(images) > limit:
            raise invalid(f"at most {limit} images per request, got {len(images)}", "messages")
        return conversation, images

    def _prompt_ids(self, conversation: list[dict]) -> list[int]:
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises arbitrary errors for bad conversations
            raise invalid(f"chat template failed: {exc}", "messages") from None
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    async def _generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        images: list[LoadedImage],
        sampling: common_pb2.SamplingParams,
    ) -> AsyncIterator[Delta]:
        if sampling.n > 1:
            raise invalid("n > 1 is not supported", "n")
        if len(prompt_ids) >= self.max_model_len:
            raise invalid(
                f"prompt has {len(prompt_ids)} tokens, the model's context is {self.max_model_len}",
                "messages",
            )
        if sampling.HasField("max_tokens") and sampling.max_tokens > self.max_model_len:
            # As vLLM: past the context alone, an error; within it, clamped to what is left.
            raise invalid(
                f"max_tokens={sampling.max_tokens} cannot be greater than "
                f"max_model_len={self.max_model_len}. Please request fewer output tokens.",
                "max_tokens",
            )
        params = to_vllm(sampling)
        detokenizer = IncrementalDetokenizer.from_new_request(
            self.tokenizer, _DetokenizerRequest(request_id, prompt_ids, params)
        )
        if request_id in self._active:
            raise invalid(f"request id {request_id!r} is already running", "request_id")
        call = self._active[request_id] = Call()
        replies = self.pipeline.run_migrating(
            request_id, prompt_ids, images, sampling, call, self.migration_limit
        )
        prompt_tokens = len(prompt_ids)
        sent = 0
        try:
            async for reply in replies:
                if reply.prompt_tokens:
                    prompt_tokens = reply.prompt_tokens
                finish = reply.finish_reason
                stop_string = detokenizer.update(
                    list(reply.token_ids), finish == common_pb2.FINISH_REASON_STOP
                )
                if stop_string:
                    finish = common_pb2.FINISH_REASON_STOP
                finished = finish != common_pb2.FINISH_REASON_UNSPECIFIED
                text = detokenizer.get_next_output_text(finished, delta=True)
                token_ids = detokenizer.output_token_ids[sent:]
                sent += len(token_ids)
                if not finished:
                    if text or token_ids:
                        yield Delta(text, list(token_ids))
                    continue
                yield Delta(text, list(token_ids), finish, _usage(prompt_tokens, sent))
                if reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    # The stage ends its stream after its last reply: read to that end, so
                    # that every stage sees its call complete rather than cancelled.
                    async for _ in replies:
                        pass
                return
        except asyncio.CancelledError:
            if not call.aborted:
                raise
            yield Delta("", [], common_pb2.FINISH_REASON_ABORT, _usage(prompt_tokens, sent))
            return
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            # Closing the pipeline cancels its open stage call and frees what it holds.
            await replies.aclose()
            self._active.pop(request_id, None)
        raise PrismError(grpc.StatusCode.INTERNAL, "worker stream ended without a finish reason")

    async def _stream(
        self,
        response_type: type[Response],
        request_id: str,
        prompt_ids: list[int],
        images: list[LoadedImage],
        sampling: common_pb2.SamplingParams,
    ) -> AsyncIterator[Response]:
        """Chat and Complete answer alike: one message per delta, usage on the last."""
        async for delta in self._generate(request_id, prompt_ids, images, sampling):
            yield response_type(
                request_id=request_id,
                model=self.served_model_name,
                text=delta.text,
                token_ids=delta.token_ids,
                finish_reason=delta.finish_reason,
                usage=delta.usage,
            )

    def _describe(self, request_id: str) -> None:
        """Names the request in this call's log lines and span."""
        if not logs.REQUEST_ID.get():
            logs.REQUEST_ID.set(request_id)
        trace.get_current_span().set_attributes({
            "prism.request_id": logs.REQUEST_ID.get(), "prism.engine_request_id": request_id,
            "prism.mode": self.pipeline.mode.name, "gen_ai.request.model": self.served_model_name,
        })  # fmt: skip

    async def chat(
        self, request: inference_pb2.ChatRequest
    ) -> AsyncIterator[inference_pb2.ChatResponse]:
        request_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        self._check_model(request.model)
        conversation, image_refs = self._conversation(list(request.messages))
        prompt_ids = self._prompt_ids(conversation)
        images = await asyncio.gather(*(self.loader.load(img, p) for img, p in image_refs))
        log.info("chat %s: %d prompt tokens, %d images", request_id, len(prompt_ids), len(images))
        replies = self._stream(
            inference_pb2.ChatResponse, request_id, prompt_ids, images, request.sampling
        )
        async for reply in replies:
            yield reply

    async def complete(
        self, request: inference_pb2.CompleteRequest
    ) -> AsyncIterator[inference_pb2.CompleteResponse]:
        request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        self._check_model(request.model)
        kind = request.WhichOneof("prompt")
        if kind == "text" and request.text:
            prompt_ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids" and request.token_ids.ids:
            prompt_ids = list(request.token_ids.ids)
            vocab = len(self.tokenizer)
            if max(prompt_ids) >= vocab:
                raise invalid(f"prompt token ids must be below {vocab}", "prompt")
        else:
            raise invalid("prompt must not be empty", "prompt")
        log.info("completion %s: %d prompt tokens", request_id, len(prompt_ids))
        replies = self._stream(
            inference_pb2.CompleteResponse, request_id, prompt_ids, [], request.sampling
        )
        async for reply in replies:
            yield reply

    async def list_models(
        self, request: inference_pb2.ListModelsRequest
    ) -> inference_pb2.ListModelsResponse:
        model = inference_pb2.Model(
            id=self.served_model_name,
            owned_by="prism",
            created=self.created,
            max_model_len=self.max_model_len,
        )
        return inference_pb2.ListModelsResponse(models=[model])

    async def abort(self, request: inference_pb2.AbortRequest) -> inference_pb2.AbortResponse:
        call = self._active.get(request.request_id)
        if call is None:
            return inference_pb2.AbortResponse(aborted=False)
        call.abort()
        return inference_pb2.AbortResponse(aborted=True)


def _usage(prompt_tokens: int, completion_tokens: int) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def context_length(model: str) -> int:
    """The model's context length, read from its config as vLLM does by default."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    text = getattr(config, "text_config", None) or config
    return int(text.max_position_embeddings)


async def serve(args: argparse.Namespace) -> None:
    deployed = mode(args.mode)
    stage = Stage(args, MeshRole.PROCESSOR)
    served_model = args.served_model_name or args.model
    for role in deployed.roles:
        await stage.registry.watch(role, discovery_tags(served_model, deployed.name))
    pipeline = Pipeline(deployed, Router(stage.registry, args.routing))
    loader = ImageLoader(
        MediaPolicy(max_images=args.max_images, fetch_allow=tuple(args.fetch_allow))
    )
    servicer = InferenceServicer(
        args.model,
        served_model,
        pipeline,
        loader,
        args.max_model_len or context_length(args.model),
        args.max_in_flight,
        args.migration_limit,
    )

    try:
        await stage.serve(
            [servicer.service],
            [args.mode],
            [telemetry.cache_collector("prism_image_cache", "Image URL", loader.url_cache.stats)],
            tasks=[lambda server: _track_readiness(server, pipeline)],
            serving=False,
        )
    finally:
        await loader.close()
        await pipeline.close()


async def _track_readiness(
    server: rpc.Server, pipeline: Pipeline, period: float = 1.0, failure_threshold: int = 3
) -> None:
    """Reports SERVING only while the stages this processor calls are serving.

    Like a Kubernetes probe, one slow health check on a busy stage is not an outage: the
    processor turns NOT_SERVING after `failure_threshold` failed probes in a row.
    """
    failures = failure_threshold
    while True:
        failures = 0 if await pipeline.ready() else failures + 1
        await server.set_serving([SERVICE], failures < failure_threshold)
        await asyncio.sleep(period)
