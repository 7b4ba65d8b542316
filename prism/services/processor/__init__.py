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
from dataclasses import dataclass
from typing import TypeVar

import grpc
from opentelemetry import trace
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from prism import logs, rpc, telemetry
from prism.media import MediaLoader, PromptMedia, media_policy
from prism.modes import MeshRole, mode
from prism.registry import discovery_tags
from prism.routing import Router
from prism.rpc import PrismError, invalid
from prism.runtime.service import Service
from prism.runtime.stage import Stage
from prism.sampling import to_vllm
from prism.services.processor.chat import ChatRenderer
from prism.services.processor.checks import check_model, check_sampling
from prism.services.processor.completion import CompletionRenderer
from prism.services.processor.detokenize import Delta, Detokenizer
from prism.services.processor.failover import Call
from prism.services.processor.fan_out import UsageTally, merge, split
from prism.services.processor.inputs import ModelInputs, Prompt
from prism.services.processor.logprobs import Logprobs
from prism.services.processor.parsing import ChatParsing, Parsers, Step
from prism.services.processor.pipeline import Pipeline
from prism.stage.v1 import engine_pb2
from prism.v1 import common_pb2, inference_pb2, inference_pb2_grpc

SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name

Response = TypeVar("Response", inference_pb2.ChatResponse, inference_pb2.CompleteResponse)


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
        answer = _Answer(response_type, request_id, prompt_ids, media,
                         UsageTally(len(prompt_ids), len(choices)), echo, parsing)  # fmt: skip
        streams = [
            self._choice(answer, index, engine_id, params, calls[index])
            for index, (engine_id, params) in enumerate(choices)
        ]
        try:
            async for response in streams[0] if len(streams) == 1 else merge(streams):
                yield response
        finally:
            self._active.pop(request_id, None)

    async def _choice(
        self,
        answer: _Answer,
        index: int,
        engine_id: str,
        sampling: common_pb2.SamplingParams,
        call: Call,
    ) -> AsyncIterator[Response]:
        """One choice's messages, each with the request's usage so far."""
        prompt_ids, tally, echo = answer.prompt_ids, answer.tally, answer.echo
        params = to_vllm(sampling)
        detokenizer = Detokenizer(self.tokenizer, engine_id, prompt_ids, params)
        logprobs = Logprobs(self.tokenizer, params)
        parsing = answer.parsing.choice() if answer.parsing is not None else None
        replies = self.pipeline.run(
            engine_id, prompt_ids, answer.media, sampling, call, self.migration_limit
        )
        started = False
        # Tokens whose text the parsers held back, sent with the next message.
        held: list[int] = []

        def response(delta: Delta, positions: list, reply: engine_pb2.GenerateResponse | None):
            nonlocal started
            message = answer.response_type(
                request_id=answer.request_id,
                model=self.served_model_name,
                index=index,
                text=delta.text,
                token_ids=delta.token_ids,
                finish_reason=delta.finish_reason,
                logprobs=positions,
            )
            if not started:
                started = True
                first = reply.first if reply is not None else engine_pb2.PromptUsage()
                prompt_positions = logprobs.prompt(prompt_ids, first.prompt_logprobs)
                if answer.response_type is inference_pb2.CompleteResponse:
                    message.prompt_logprobs.extend(prompt_positions)
                if echo is not None:
                    message.text = echo + message.text
                    message.token_ids[:0] = prompt_ids
                    if sampling.HasField("logprobs"):
                        positions = [*prompt_positions, *message.logprobs]
                        del message.logprobs[:]
                        message.logprobs.extend(positions)
            tally.sent[index] = detokenizer.sent
            message.usage.CopyFrom(tally.usage())
            return message

        def parsed(
            delta: Delta, positions: list, reply: engine_pb2.GenerateResponse
        ) -> Response | None:
            """The message of `delta` where a chat's output is parsed; None where vLLM's
            server would send nothing for it."""
            assert parsing is not None
            step = parsing.step(delta.text, delta.token_ids, delta.finished)
            if step is None and not delta.finished and not positions:
                held.extend(delta.token_ids)
                return None
            step = step or Step()
            ids = [*held, *delta.token_ids]
            held.clear()
            reason = parsing.finish_reason(delta.finish_reason) if delta.finished else 0
            if delta.finished:
                tally.reasoning[index] = parsing.reasoning_tokens()
            message = response(Delta(step.content, ids, reason), positions, reply)
            message.reasoning = step.reasoning
            message.tool_calls.extend(step.tool_calls)
            if delta.finished:
                message.parsed.CopyFrom(parsing.whole(delta.finish_reason))
            return message

        try:
            async for reply in replies:
                if reply.HasField("first"):
                    tally.prompt(reply.first)
                delta = detokenizer.update(list(reply.token_ids), reply.last.reason)
                positions = logprobs.output(reply.logprobs[: len(delta.token_ids)])
                if not (delta.finished or delta.text or delta.token_ids):
                    continue
                if parsing is not None:
                    message = parsed(delta, positions, reply)
                    if message is not None:
                        yield message
                else:
                    yield response(delta, positions, reply)
                if not delta.finished:
                    continue
                if reply.HasField("last"):
                    # The stage ends its stream after its last reply: read to that end, so
                    # that every stage sees its call complete rather than cancelled.
                    async for _ in replies:
                        pass
                return
        except asyncio.CancelledError:
            if not call.aborted:
                raise
            yield response(Delta("", [], common_pb2.FINISH_REASON_ABORT), [], None)
            return
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            # Closing the pipeline cancels its open stage call and frees what it holds.
            await replies.aclose()
        raise PrismError(grpc.StatusCode.INTERNAL, "worker stream ended without a finish reason")

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


@dataclass
class _Answer:
    """What the choices of one request share."""

    response_type: type
    request_id: str
    prompt_ids: list[int]
    media: PromptMedia
    tally: UsageTally
    # The prompt's text, which starts each choice (completions' `echo`).
    echo: str | None
    # A chat's tools and parsers, where the server parses the output.
    parsing: ChatParsing | None = None


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
