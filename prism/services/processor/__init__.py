"""The processor stage: the public `InferenceService`.

It applies the model's chat template, tokenizes, loads and validates images, runs the
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
from typing import TypeVar

import grpc
from opentelemetry import trace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prism import logs, rpc, telemetry
from prism.media import LoadedImage, MediaLoader, MediaPolicy
from prism.modes import MeshRole, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc import PrismError, invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.sampling import to_vllm
from prism.services.processor.detokenize import Detokenizer
from prism.services.processor.failover import Call
from prism.services.processor.pipeline import Pipeline
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
# A request's prompt: its token ids and its images.
Prompt = tuple[list[int], list[LoadedImage]]


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
    ):
        self.tokenizer = tokenizer
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
        conversation, image_refs = self._conversation(list(request.messages))
        prompt_ids = self._prompt_ids(conversation)

        async def prompt() -> Prompt:
            images = await asyncio.gather(*(self.loader.load(img, p) for img, p in image_refs))
            log.info("chat %s: %d prompt tokens, %d images", request_id, len(prompt_ids),
                     len(images))  # fmt: skip
            return prompt_ids, list(images)

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
            return prompt_ids, []

        return self._answer(inference_pb2.CompleteResponse, request_id, prompt(), request.sampling)

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

    async def _answer(
        self,
        response_type: type[Response],
        request_id: str,
        prompt: Awaitable[Prompt],
        sampling: common_pb2.SamplingParams,
    ) -> AsyncIterator[Response]:
        """Chat and Complete answer alike: one message per delta, usage on the last."""
        prompt_ids, images = await prompt
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
            request_id, prompt_ids, images, sampling, call, self.migration_limit
        )
        prompt_tokens = len(prompt_ids)

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
                    prompt_tokens = reply.first.prompt_tokens
                delta = detokenizer.update(list(reply.token_ids), reply.last.reason)
                if not delta.finished:
                    if delta.text or delta.token_ids:
                        yield response(delta.text, delta.token_ids, delta.finish_reason)
                    continue
                usage = _usage(prompt_tokens, detokenizer.sent)
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
            usage = _usage(prompt_tokens, detokenizer.sent)
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
    loader = MediaLoader(
        MediaPolicy(max_images=args.max_images, fetch_allow=tuple(args.fetch_allow))
    )
    servicer = InferenceServicer(
        AutoTokenizer.from_pretrained(args.model),
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
