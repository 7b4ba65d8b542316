"""The processor stage: the public `InferenceService`.

It applies the model's chat template, tokenizes, loads and validates images and videos
(and checks image embeddings a client sent), runs the
request through the pipeline of its mode (prism.services.processor.pipeline, with
failover), and turns the token ids that come back into text deltas
(prism.services.processor.detokenize).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc
from opentelemetry import trace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prism import embeds, logs, rpc, telemetry
from prism.media import MediaLoader, PromptMedia, media_policy
from prism.modes import MeshRole, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc import PrismError, invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.sampling import to_vllm
from prism.services.processor.detokenize import Detokenizer
from prism.services.processor.failover import Call
from prism.services.processor.inputs import ModelInputs
from prism.services.processor.pipeline import Pipeline
from prism.stage.v1 import encoder_pb2, engine_pb2
from prism.v1 import common_pb2, errors_pb2, inference_pb2, inference_pb2_grpc

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
# A request's prompt: its token ids and its media.
Prompt = tuple[list[int], PromptMedia]


@dataclass
class _MediaParts:
    """A conversation's media parts, before loading."""

    images: list[tuple[common_pb2.Image, str]] = field(default_factory=list)
    videos: list[tuple[common_pb2.Video, str]] = field(default_factory=list)
    embeddings: list[encoder_pb2.EmbeddingHandle] = field(default_factory=list)


class InferenceServicer:
    """The handlers of `InferenceService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        served_model_name: str,
        pipeline: Pipeline,
        loader: MediaLoader,
        max_model_len: int,
        max_in_flight: int = 0,
        migration_limit: int = 1,
        inputs: ModelInputs | None = None,
    ):
        self.tokenizer = tokenizer
        self.inputs = inputs or ModelInputs()
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

    def _describe(self, request_id: str) -> None:
        """Names the request in this call's log lines and span."""
        if not logs.REQUEST_ID.get():
            logs.REQUEST_ID.set(request_id)
        trace.get_current_span().set_attributes({
            "prism.request_id": logs.REQUEST_ID.get(), "prism.engine_request_id": request_id,
            "prism.mode": self.pipeline.mode.name, "gen_ai.request.model": self.served_model_name,
        })  # fmt: skip

    def chat(self, request: inference_pb2.ChatRequest) -> AsyncIterator[inference_pb2.ChatResponse]:
        request_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        self._check_model(request.model)
        conversation, parts = self._conversation(list(request.messages))
        prompt_ids = self._prompt_ids(conversation)

        async def prompt() -> Prompt:
            images, videos = await asyncio.gather(
                asyncio.gather(*(self.loader.load(image, p) for image, p in parts.images)),
                asyncio.gather(*(self.loader.load_video(video, p) for video, p in parts.videos)),
            )
            log.info("chat %s: %d prompt tokens, %d images, %d videos, %d image embeddings",
                     request_id, len(prompt_ids), len(images), len(videos),
                     len(parts.embeddings))  # fmt: skip
            return prompt_ids, PromptMedia(list(images), list(videos), parts.embeddings)

        return self._answer(inference_pb2.ChatResponse, request_id, prompt(), request.sampling)

    def complete(
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

        async def prompt() -> Prompt:
            log.info("completion %s: %d prompt tokens", request_id, len(prompt_ids))
            return prompt_ids, PromptMedia()

        return self._answer(inference_pb2.CompleteResponse, request_id, prompt(), request.sampling)

    def _conversation(
        self, messages: list[inference_pb2.ChatMessage]
    ) -> tuple[list[dict], _MediaParts]:
        if not messages:
            raise invalid("messages must not be empty", "messages")
        conversation, media = [], _MediaParts()
        for i, message in enumerate(messages):
            role = _ROLE_NAMES.get(message.role)
            if role is None:
                raise invalid(f"messages[{i}].role is missing or unknown", f"messages[{i}].role")
            parts: list[dict] = []
            for j, part in enumerate(message.content):
                kind = part.WhichOneof("part")
                where = f"messages[{i}].content[{j}]"
                if kind == "text":
                    parts.append({"type": "text", "text": part.text})
                    continue
                if kind is None:
                    raise invalid("content part is empty", where)
                if role != "user":
                    raise invalid("images and videos are allowed in user messages only", where)
                if kind == "image":
                    parts.append({"type": "image"})
                    media.images.append((part.image, f"{where}.image_url"))
                elif kind == "video":
                    if not self.inputs.video:
                        raise invalid("this model does not accept video", f"{where}.video_url")
                    parts.append({"type": "video"})
                    media.videos.append((part.video, f"{where}.video_url"))
                else:
                    parts.append({"type": "image"})
                    media.embeddings.append(self._embedding(part.image_embedding, where))
            conversation.append({"role": role, "content": parts})
        self._check_counts(media)
        return conversation, media

    def _embedding(
        self, embedding: common_pb2.ImageEmbedding, where: str
    ) -> encoder_pb2.EmbeddingHandle:
        param = f"{where}.image_embeds"
        if not self.inputs.embeddings_enabled:
            raise invalid(
                "image_embeds are not enabled: start Prism with --enable-mm-embeds", param
            )
        if self.inputs.embeddings is None:
            raise invalid("image_embeds cannot be checked for this model's family", param)
        embeds.check(embedding, self.inputs.embeddings, param)
        return embeds.to_handle(embedding)

    def _check_counts(self, media: _MediaParts) -> None:
        policy = self.loader.policy
        if media.images and media.embeddings:
            # As vLLM: one modality comes as pixels or as embeddings, not both.
            raise invalid("a request cannot mix images and image_embeds", "messages")
        if media.embeddings and media.videos and not self.pipeline.mode.has_encoder:
            raise invalid(
                f"in {self.pipeline.mode.name} a request with image_embeds takes no videos",
                "messages",
            )
        images = len(media.images) + len(media.embeddings)
        if images > policy.max_images:
            raise invalid(
                f"at most {policy.max_images} images per request, got {images}", "messages"
            )
        if len(media.videos) > policy.max_videos:
            raise invalid(
                f"at most {policy.max_videos} videos per request, got {len(media.videos)}",
                "messages",
            )

    def _prompt_ids(self, conversation: list[dict]) -> list[int]:
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises arbitrary errors for bad conversations
            raise invalid(f"chat template failed: {exc}", "messages") from None
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    async def _answer(
        self,
        response_type: type[Response],
        request_id: str,
        prompt: Awaitable[Prompt],
        sampling: common_pb2.SamplingParams,
    ) -> AsyncIterator[Response]:
        """Chat and Complete answer alike: one message per delta, usage on the last."""
        prompt_ids, media = await prompt
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
        detokenizer = Detokenizer(self.tokenizer, request_id, prompt_ids, to_vllm(sampling))
        if request_id in self._active:
            raise invalid(f"request id {request_id!r} is already running", "request_id")
        call = self._active[request_id] = Call()
        replies = self.pipeline.run(
            request_id, prompt_ids, media, sampling, call, self.migration_limit
        )
        # What the engine made of the prompt, once its first reply says.
        prompt_usage = engine_pb2.PromptUsage(prompt_tokens=len(prompt_ids))

        def response(text: str, token_ids: list[int], finish_reason: int, **usage) -> Response:
            return response_type(
                request_id=request_id,
                model=self.served_model_name,
                text=text,
                token_ids=token_ids,
                finish_reason=finish_reason,
                **usage,
            )

        try:
            async for reply in replies:
                if reply.HasField("first"):
                    prompt_usage = reply.first
                delta = detokenizer.update(list(reply.token_ids), reply.last.reason)
                if not delta.finished:
                    if delta.text or delta.token_ids:
                        yield response(delta.text, delta.token_ids, delta.finish_reason)
                    continue
                usage = _usage(prompt_usage, detokenizer.sent)
                yield response(delta.text, delta.token_ids, delta.finish_reason, usage=usage)
                if reply.HasField("last"):
                    # The stage ends its stream after its last reply: read to that end, so
                    # that every stage sees its call complete rather than cancelled.
                    async for _ in replies:
                        pass
                return
        except asyncio.CancelledError:
            if not call.aborted:
                raise
            usage = _usage(prompt_usage, detokenizer.sent)
            yield response("", [], common_pb2.FINISH_REASON_ABORT, usage=usage)
            return
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            # Closing the pipeline cancels its open stage call and frees what it holds.
            await replies.aclose()
            self._active.pop(request_id, None)
        raise PrismError(grpc.StatusCode.INTERNAL, "worker stream ended without a finish reason")

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


def _usage(prompt: engine_pb2.PromptUsage, completion_tokens: int) -> common_pb2.Usage:
    return common_pb2.Usage(
        prompt_tokens=prompt.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt.prompt_tokens + completion_tokens,
        cached_tokens=prompt.cached_tokens,
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
    # `kv` routing keys the blocks of a prompt's images, which needs their token counts.
    inputs = ModelInputs.of(args.model, args.enable_mm_embeds, count_tokens=args.routing == "kv")
    router = Router(stage.registry, args.routing, overlap_weight=args.kv_overlap_weight)
    pipeline = Pipeline(deployed, router, inputs)
    loader = MediaLoader(media_policy(args))
    servicer = InferenceServicer(
        AutoTokenizer.from_pretrained(args.model),
        served_model,
        pipeline,
        loader,
        args.max_model_len or context_length(args.model),
        args.max_in_flight,
        args.migration_limit,
        inputs,
    )

    try:
        await stage.serve(
            [servicer.service],
            [args.mode],
            [
                telemetry.cache_collector(
                    "prism_image_cache", "Image and video URL", loader.url_cache.stats
                )
            ],
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
