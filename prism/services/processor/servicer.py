"""The handlers of the public `InferenceService`, each a few lines: a request is rendered
by its kind (prism.services.processor.chat, .completion), checked
(prism.services.processor.checks), fanned out into its choices
(prism.services.processor.fan_out), each run through the mode's pipeline and answered
(prism.services.processor.choice), as vLLM's v1 engine goes from input processor to
parallel sampling to output processor."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable

from opentelemetry import trace
from transformers import PreTrainedTokenizerBase

from prism import logs
from prism.engine.parsing import ChatParsing, Parsers
from prism.media.fetch import MediaLoader
from prism.media.prompt import PromptMedia
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.rpc.errors import invalid
from prism.rpc.server import InFlightLimit
from prism.runtime.service import Service
from prism.services.processor.adapters import ServedModels
from prism.services.processor.chat import ChatRenderer
from prism.services.processor.checks import check_sampling
from prism.services.processor.choice import ChoiceAnswer, RequestAnswer, Response
from prism.services.processor.completion import CompletionRenderer
from prism.services.processor.counting import TokenCounter
from prism.services.processor.failover import StageCalls
from prism.services.processor.fan_out import UsageTally, merge, split
from prism.services.processor.inputs import ModelInputs, Prompt
from prism.services.processor.pipeline import Pipeline


class InferenceServicer:
    """The handlers of `InferenceService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        models: ServedModels,
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
        self.models = models
        self.pipeline = pipeline
        self.max_model_len = max_model_len
        self.created = int(time.time())
        # Whether the stages behind can take a request: models are listed only then.
        self.ready = False
        # Running request ids -> each choice's stage calls.
        self._active: dict[str, list[StageCalls]] = {}
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
            inference_pb2_grpc,
            InFlightLimit(max_in_flight),
        )
        self.service.stream("Chat", self.chat, timed=True)
        self.service.stream("Complete", self.complete, timed=True)
        self.service.unary("ListModels", self.list_models)
        self.service.unary("Abort", self.abort)
        self.service.unary("CountTokens", TokenCounter(self._chat, self.models).count)

    def chat(self, request: inference_pb2.ChatRequest) -> AsyncIterator[inference_pb2.ChatResponse]:
        request_id = request.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        adapter = self.models.resolve(request.model)
        prompt, parsing = self._chat.render(request, request_id)
        return self._answer(inference_pb2.ChatResponse, request_id, prompt, request.sampling,
                            adapter, parsing=parsing)  # fmt: skip

    def complete(
        self, request: inference_pb2.CompleteRequest
    ) -> AsyncIterator[inference_pb2.CompleteResponse]:
        request_id = request.request_id or f"cmpl-{uuid.uuid4().hex}"
        self._describe(request_id)
        adapter = self.models.resolve(request.model)
        prompt, echo = self._completion.render(request, request_id)
        return self._answer(
            inference_pb2.CompleteResponse, request_id, prompt, request.sampling, adapter, echo
        )

    async def list_models(
        self, request: inference_pb2.ListModelsRequest
    ) -> inference_pb2.ListModelsResponse:
        if not self.ready:
            # As Dynamo lists a model only once a worker has registered it: a client that
            # waits for the model to be listed is not sent in before it can be served.
            return inference_pb2.ListModelsResponse()
        return inference_pb2.ListModelsResponse(
            models=self.models.listed(self.created, self.max_model_len)
        )

    async def abort(self, request: inference_pb2.AbortRequest) -> inference_pb2.AbortResponse:
        calls = self._active.get(request.request_id)
        if calls is None:
            return inference_pb2.AbortResponse(aborted=False)
        for call in calls:
            call.abort()
        return inference_pb2.AbortResponse(aborted=True)

    def _describe(self, request_id: str) -> None:
        """Names the request in this call's log lines and span."""
        if not logs.REQUEST_ID.get():
            logs.REQUEST_ID.set(request_id)
        trace.get_current_span().set_attributes({
            "prism.request_id": logs.REQUEST_ID.get(), "prism.engine_request_id": request_id,
            "prism.mode": self.pipeline.mode.name, "gen_ai.request.model": self.models.name,
        })  # fmt: skip

    async def _answer(
        self,
        response_type: type[Response],
        request_id: str,
        prompt: Awaitable[Prompt],
        sampling: common_pb2.SamplingParams,
        adapter: engine_pb2.LoraAdapter | None,
        echo: str | None = None,
        parsing: ChatParsing | None = None,
    ) -> AsyncIterator[Response]:
        """Chat and Complete answer alike: one message per delta of each choice, by the
        base model or the LoRA `adapter`. `echo`: the prompt's text, which then starts
        each choice; `parsing`: a chat's parsers."""
        prompt_ids, media = await prompt
        check_sampling(sampling, prompt_ids, self.max_model_len, self.tokenizer)
        if request_id in self._active:
            raise invalid(f"request id {request_id!r} is already running", "request_id")
        choices = split(request_id, sampling)
        calls = self._active[request_id] = [StageCalls() for _ in choices]
        tally = UsageTally(len(prompt_ids), len(choices))
        answer = RequestAnswer(
            response_type, request_id, adapter.name if adapter else self.models.name, prompt_ids,
            tally, echo, parsing,
        )  # fmt: skip
        try:
            streams = [
                self._choice(answer, index, engine_id, params, media, calls[index], adapter)
                for index, (engine_id, params) in enumerate(choices)
            ]
            async for response in streams[0] if len(streams) == 1 else merge(streams):
                yield response
            self.models.count(adapter, tally.usage())
        finally:
            self._active.pop(request_id, None)

    def _choice(
        self,
        answer: RequestAnswer[Response],
        index: int,
        engine_id: str,
        sampling: common_pb2.SamplingParams,
        media: PromptMedia,
        call: StageCalls,
        adapter: engine_pb2.LoraAdapter | None,
    ) -> AsyncIterator[Response]:
        """One choice's messages, its engine request run through the mode's pipeline."""
        replies = self.pipeline.run(
            engine_id, answer.prompt_ids, media, sampling, call, self.migration_limit, adapter
        )
        choice = ChoiceAnswer(answer, index, engine_id, sampling, self.tokenizer)
        return choice.stream(replies, call)
