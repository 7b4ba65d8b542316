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
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from opentelemetry import trace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prism import logs, rpc, telemetry
from prism.media import MediaLoader, PromptMedia, media_policy
from prism.modes import MeshRole, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc import invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.services.processor.chat import ChatRenderer
from prism.services.processor.checks import check_model, check_sampling
from prism.services.processor.choice import ChoiceAnswer, RequestAnswer, Response
from prism.services.processor.completion import CompletionRenderer
from prism.services.processor.failover import Call
from prism.services.processor.fan_out import UsageTally, merge, split
from prism.services.processor.inputs import ModelInputs, Prompt
from prism.services.processor.parsing import ChatParsing, Parsers
from prism.services.processor.pipeline import Pipeline
from prism.v1 import common_pb2, inference_pb2, inference_pb2_grpc

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name


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
        parsers: Parsers | None = None,
    ):
        self.tokenizer = tokenizer
        inputs = inputs or ModelInputs()
        self._chat = ChatRenderer(tokenizer, parsers or Parsers(), inputs, loader, pipeline.mode)
        self._completion = CompletionRenderer(tokenizer, inputs, loader)
        self.migration_limit = migration_limit
        self.served_model_name = served_model_name
        self.pipeline = pipeline
        self.max_model_len = max_model_len
        self.created = int(time.time())
        # Whether the stages behind can take a request: models are listed only then.
        self.ready = False
        # Running request ids -> each choice's stage calls.
        self._active: dict[str, list[Call]] = {}
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
            rpc.InFlightLimit(max_in_flight),
        )
        self.service.stream("Chat", self.chat, timed=True)
        self.service.stream("Complete", self.complete, timed=True)
        self.service.unary("ListModels", self.list_models)
        self.service.unary("Abort", self.abort)

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
        check_model(request.model, self.served_model_name)
        prompt, parsing = self._chat.render(request, request_id)
        return self._answer(
            inference_pb2.ChatResponse, request_id, prompt, request.sampling, parsing=parsing
        )

    def complete(
        self, request: inference_pb2.CompleteRequest
    ) -> AsyncIterator[inference_pb2.CompleteResponse]:
        request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        check_model(request.model, self.served_model_name)
        prompt, echo = self._completion.render(request, request_id)
        return self._answer(
            inference_pb2.CompleteResponse, request_id, prompt, request.sampling, echo
        )

    async def _answer(
        self,
        response_type: type[Response],
        request_id: str,
        prompt: Awaitable[Prompt],
        sampling: common_pb2.SamplingParams,
        echo: str | None = None,
        parsing: ChatParsing | None = None,
    ) -> AsyncIterator[Response]:
        """Chat and Complete answer alike: one message per delta of each choice. `echo`:
        the prompt's text, which then starts each choice; `parsing`: a chat's parsers."""
        prompt_ids, media = await prompt
        check_sampling(sampling, prompt_ids, self.max_model_len, self.tokenizer)
        if request_id in self._active:
            raise invalid(f"request id {request_id!r} is already running", "request_id")
        choices = split(request_id, sampling)
        calls = self._active[request_id] = [Call() for _ in choices]
        tally = UsageTally(len(prompt_ids), len(choices))
        answer = RequestAnswer(
            response_type, request_id, self.served_model_name, prompt_ids, tally, echo, parsing
        )
        try:
            streams = [
                self._choice(answer, index, engine_id, params, media, calls[index])
                for index, (engine_id, params) in enumerate(choices)
            ]
            async for response in streams[0] if len(streams) == 1 else merge(streams):
                yield response
        finally:
            self._active.pop(request_id, None)

    def _choice(
        self,
        answer: RequestAnswer[Response],
        index: int,
        engine_id: str,
        sampling: common_pb2.SamplingParams,
        media: PromptMedia,
        call: Call,
    ) -> AsyncIterator[Response]:
        """One choice's messages, its engine request run through the mode's pipeline."""
        replies = self.pipeline.run(
            engine_id, answer.prompt_ids, media, sampling, call, self.migration_limit
        )
        choice = ChoiceAnswer(answer, index, engine_id, sampling, self.tokenizer)
        return choice.stream(replies, call)

    async def list_models(
        self, request: inference_pb2.ListModelsRequest
    ) -> inference_pb2.ListModelsResponse:
        if not self.ready:
            # As Dynamo lists a model only once a worker has registered it: a client that
            # waits for the model to be listed is not sent in before it can be served.
            return inference_pb2.ListModelsResponse()
        model = inference_pb2.Model(
            id=self.served_model_name,
            owned_by="prism",
            created=self.created,
            max_model_len=self.max_model_len,
        )
        return inference_pb2.ListModelsResponse(models=[model])

    async def abort(self, request: inference_pb2.AbortRequest) -> inference_pb2.AbortResponse:
        calls = self._active.get(request.request_id)
        if calls is None:
            return inference_pb2.AbortResponse(aborted=False)
        for call in calls:
            call.abort()
        return inference_pb2.AbortResponse(aborted=True)


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
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    try:
        parsers = Parsers.of(tokenizer, args.tool_call_parser, args.reasoning_parser,
                             args.enable_auto_tool_choice)  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"prism processor: {exc}") from None
    servicer = InferenceServicer(
        tokenizer,
        served_model,
        pipeline,
        loader,
        args.max_model_len or context_length(args.model),
        args.max_in_flight,
        args.migration_limit,
        inputs,
        parsers,
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
            tasks=[lambda server: _track_readiness(server, pipeline, servicer)],
            serving=False,
        )
    finally:
        await loader.close()
        await pipeline.close()


async def _track_readiness(
    server: rpc.Server,
    pipeline: Pipeline,
    servicer: InferenceServicer,
    period: float = 1.0,
    failure_threshold: int = 3,
) -> None:
    """Reports SERVING, and lists the model, only while the stages this processor calls
    are serving.

    Like a Kubernetes probe, one slow health check on a busy stage is not an outage: the
    processor turns NOT_SERVING after `failure_threshold` failed probes in a row.
    """
    failures = failure_threshold
    while True:
        failures = 0 if await pipeline.ready() else failures + 1
        servicer.ready = failures < failure_threshold
        await server.set_serving([SERVICE], servicer.ready)
        await asyncio.sleep(period)
