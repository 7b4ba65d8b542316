"""The worker stage on a vLLM engine: `EngineService` on one `AsyncLLM`, in one role.

The worker takes token ids (never text) and streams token ids back; templating,
detokenization and stop strings are the processor's. Cancelling a `Generate` call, or
`Abort`, aborts the request inside vLLM so its KV blocks are freed at once. What differs
between roles (aggregated, prefill, encode-prefill, decode) is the role's
(prism.services.worker.roles): the processor carries prefill's hand-off to decode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import uuid4

import grpc
import torch
from opentelemetry.trace import Span

from prism import logs, telemetry
from prism.engine import calls
from prism.engine.lora import LoraAdapters, LoRARequest
from prism.engine.types import (
    AsyncLLM,
    EngineDeadError,
    FlatLogprobs,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    TokensPrompt,
    VLLMClientError,
)
from prism.media.audio import AUDIO, AudioDecoder
from prism.media.image import IMAGE, decode_image
from prism.media.modalities import MODALITIES
from prism.media.modality import Modality
from prism.media.video import VIDEO, VideoDecoder
from prism.proto.stage.v1 import encoder_pb2, engine_pb2
from prism.proto.v1 import common_pb2, errors_pb2
from prism.rpc.errors import PrismError, invalid
from prism.rpc.server import Server
from prism.services.worker import check_request, engine_service
from prism.services.worker.roles import Role
from prism.tracing import tracer
from prism.transfer import Transfer, TransferError

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}
# The engine's health: checked this often; after this long without an output a one-token
# canary proves it still generates, and fails past its timeout.
_WATCH_S = 2.0
_CANARY_AFTER_S = 10.0
_CANARY_TIMEOUT_S = 5.0


def _uuids(
    media: engine_pb2.MediaFiles | encoder_pb2.MediaEmbeddings,
    uuid: Callable[[Modality, Any], str],
) -> dict[str, list[str]]:
    """The uuid of each item of `media`, by modality."""
    groups = ((m, m.items(media)) for m in MODALITIES)
    return {m.name: [uuid(m, item) for item in items] for m, items in groups if items}


def _decoders(
    videos: VideoDecoder | None, audios: AudioDecoder | None
) -> dict[str, Callable[[bytes], Any]]:
    """How a worker decodes each modality's files as the engine takes them, by modality
    name: videos and audio only where it decodes them."""
    decoders: dict[str, Callable[[bytes], Any]] = {IMAGE.name: decode_image}
    if audios is not None:
        decoders[AUDIO.name] = audios.decode
    if videos is None:
        return decoders

    def decode_video(data: bytes) -> Any:
        try:
            return videos.decode(data)
        except ValueError as exc:
            raise ValueError(f"video cannot be decoded: {exc}") from None

    return {**decoders, VIDEO.name: decode_video}


def engine_logprobs(flat: FlatLogprobs | None, top: int) -> list[engine_pb2.EngineLogprobs]:
    """Each position of `flat`: its own token, then the `top` most likely by rank.

    vLLM lists the own token and then the top ones, the own token twice when it is among
    them; but where its output processor merges deltas that the caller had not read yet,
    they pass through dicts, which keep it once. Both forms give the same list here.
    """
    if not flat:
        return []
    positions = []
    for start, end in zip(flat.start_indices, flat.end_indices, strict=True):
        entries: dict[int, tuple[int, float]] = {}
        for index in range(start, end):
            entries.setdefault(
                flat.token_ids[index], (flat.ranks[index] or 0, flat.logprobs[index])
            )
        ranked = sorted((item for item in entries.items() if 0 < item[1][0] <= top),
                        key=lambda item: item[1][0])  # fmt: skip
        own = flat.token_ids[start]
        positions.append(
            engine_pb2.EngineLogprobs(
                token_ids=[own, *(token for token, _ in ranked)],
                logprobs=[flat.logprobs[start], *(value for _, (_, value) in ranked)],
                rank=flat.ranks[start] or 0,
            )
        )
    return positions


def _describe_prompt(
    first: engine_pb2.PromptUsage, output: RequestOutput, params: SamplingParams, span: Span
) -> None:
    """The first reply's account of the prompt: its tokens, those the cache held, and
    their log probabilities when asked for."""
    first.prompt_tokens = len(output.prompt_token_ids or ())
    first.cached_tokens = output.num_cached_tokens or 0
    if output.prompt_logprobs:
        # Its first position, the prompt's first token, has none.
        top = params.prompt_logprobs or 0
        first.prompt_logprobs.extend(engine_logprobs(output.prompt_logprobs[1:], top))
    span.set_attributes({
        "gen_ai.usage.input_tokens": first.prompt_tokens,
        "prism.cached_tokens": first.cached_tokens,
    })  # fmt: skip


@dataclass
class _Run:
    """How far a request got: its last reply sent with the role's hand-off; its call
    completed."""

    handed_off: bool = False
    completed: bool = False


class EngineServicer:
    """The handlers of `EngineService`, served by the stage runtime as `service`."""

    def __init__(
        self,
        engine: AsyncLLM,
        role: Role,
        transfer: Transfer | None = None,
        max_in_flight: int = 0,
        videos: VideoDecoder | None = None,
        audios: AudioDecoder | None = None,
    ):
        self.engine = engine
        self.role = role
        self.loras = LoraAdapters(engine)
        self.transfer = transfer
        self.decoders = _decoders(videos, audios)
        # Running request ids -> whether an Abort came for them.
        self._running: dict[str, bool] = {}
        # When the engine last produced an output: traffic proves it generates.
        self._last_output = time.monotonic()
        self.service = engine_service(self.generate, self.abort, max_in_flight)
        self.service.hold_while(role.holding)

    def _decode(self, files: engine_pb2.MediaFiles) -> dict[str, list]:
        """The files' pixels (videos: sampled frames) as the engine takes them."""
        data: dict[str, list] = {}
        for modality in MODALITIES:
            decode = self.decoders.get(modality.name)
            for index, item in enumerate(modality.items(files)):
                param = f"{modality.field}[{index}]"
                if decode is None:
                    raise invalid(f"this worker takes no {modality.field}", param)
                try:
                    data.setdefault(modality.name, []).append(decode(item.data))
                except ValueError as exc:
                    raise invalid(str(exc), param) from None
        return data

    async def _fetch(self, embeddings: encoder_pb2.MediaEmbeddings) -> dict[str, object]:
        if self.transfer is None:
            raise invalid("this worker takes media, not embeddings", "embeddings")
        transfer = self.transfer

        def read(handle: encoder_pb2.EmbeddingHandle) -> torch.Tensor:
            location = handle.embeddings.WhichOneof("location") or "none"
            with tracer.start_as_current_span(f"{location}.read") as span:
                start = time.perf_counter()
                tensor = transfer.fetch(handle.embeddings)
                seconds = time.perf_counter() - start
                telemetry.NIXL_READ_SECONDS.labels("embeddings").observe(seconds)
                span.set_attributes({
                    "prism.transfer.bytes": tensor.numel() * tensor.element_size(),
                    "prism.transfer.seconds": seconds,
                })  # fmt: skip
                if location == "nixl":
                    span.set_attribute("prism.nixl.peer", handle.embeddings.nixl.agent_name)
                return tensor

        groups = [(m.name, m.items(embeddings)) for m in MODALITIES if m.items(embeddings)]
        try:
            tensors = await asyncio.gather(*(
                asyncio.gather(*(asyncio.to_thread(read, h) for h in items)) for _, items in groups
            ))  # fmt: skip
        except TransferError as exc:
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                f"embeddings could not be read: {exc}",
                reason=errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE,
                param="embeddings",
            ) from None
        return {
            modality: calls.embeddings_input(
                modality,
                list(group),
                [h.grid_thw for h in items],
                [h.second_per_grid_ts for h in items],
            )
            for (modality, items), group in zip(groups, tensors, strict=True)
        }

    def _params(self, request: engine_pb2.GenerateRequest) -> SamplingParams:
        # Stop strings need text: the processor applies them, the engine never sees them.
        return self.role.params(
            request,
            stop=None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            flat_logprobs=True,
        )

    async def _prompt(self, request: engine_pb2.GenerateRequest) -> TokensPrompt:
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        media = request.WhichOneof("media")
        # Each item's uuid is its content hash, in every role: vLLM then keys the prefix
        # cache blocks that hold it by what the processor knows of it (prism.kv_index).
        if media == "files":
            prompt["multi_modal_data"] = await asyncio.to_thread(self._decode, request.files)
            prompt["multi_modal_uuids"] = _uuids(
                request.files, lambda modality, file: modality.content_hash(file.data)
            )
        elif media == "embeddings":
            prompt["multi_modal_data"] = await self._fetch(request.embeddings)
            prompt["multi_modal_uuids"] = _uuids(
                request.embeddings, lambda _, item: item.content_hash
            )
        elif media == "layouts":
            prompt.update(self.role.placeholders(request.layouts))
        return prompt

    async def generate(
        self, request: engine_pb2.GenerateRequest
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        check_request(request)
        params = self._params(request)
        prompt = await self._prompt(request)
        request_id = request.request_id
        self._running[request_id] = False
        run = _Run()
        try:
            lora = await self.loras.request(request.adapter.name, request.adapter.path)
            engine_input, layouts = await self.role.render(prompt)
            async with aclosing(
                self._replies(request, engine_input, params, lora, layouts, run)
            ) as replies:
                async for reply in replies:
                    yield reply
            run.completed = True
        except (ValueError, VLLMClientError) as exc:
            # vLLM rejects bad prompts (too long, image count) with these.
            raise invalid(str(exc), param=getattr(exc, "parameter", None)) from None
        except EngineDeadError:
            # This replica is gone, as if its process were: the processor tries another
            # or migrates the request, and the worker exits to be started again (watch).
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.role.name} worker: its vLLM engine core died (EngineDeadError); "
                "the worker restarts",
            ) from None
        finally:
            aborted = self._running.pop(request_id, False)
            self.role.settle(request_id, run.handed_off, run.completed, aborted)

    async def _replies(
        self,
        request: engine_pb2.GenerateRequest,
        engine_input: Any,
        params: SamplingParams,
        lora: LoRARequest | None,
        layouts: engine_pb2.MediaLayouts,
        run: _Run,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The engine's outputs as replies: the first describes the prompt, the last says
        how it ended and carries the role's hand-off."""
        request_id = request.request_id
        # Not made current: this generator yields, and may be closed from another task,
        # where a context attached here could not be detached.
        span = tracer.start_span(self.role.span_name)
        span.set_attributes({
            "prism.request_id": logs.REQUEST_ID.get(),
            "prism.engine_request_id": request_id,
        })  # fmt: skip
        first = True
        generated = 0
        try:
            async for output in self.engine.generate(
                engine_input, params, request_id, lora_request=lora
            ):
                self._last_output = time.monotonic()
                completion = output.outputs[0]
                generated += len(completion.token_ids)
                reply = engine_pb2.GenerateResponse(
                    token_ids=completion.token_ids,
                    logprobs=engine_logprobs(completion.logprobs, params.logprobs or 0),
                )
                if first:
                    first = False
                    _describe_prompt(reply.first, output, params, span)
                    if output.finished:
                        # The first message is not the last: that one follows, tokenless.
                        yield reply
                        reply = engine_pb2.GenerateResponse()
                if output.finished:
                    self._finish(request, output, layouts, generated, span, reply.last)
                    run.handed_off = True
                yield reply
                if self._running.get(request_id) and not output.finished:
                    # vLLM drops an abort that comes before it knows the request: repeat it.
                    await self.engine.abort(request_id)
        finally:
            span.end()

    def _finish(
        self,
        request: engine_pb2.GenerateRequest,
        output: RequestOutput,
        layouts: engine_pb2.MediaLayouts,
        generated: int,
        span: Span,
        finish: engine_pb2.Finish,
    ) -> None:
        """Fills the last reply's `finish`, and hands off what the next stage reads; an
        engine that failed the request raises its role's error."""
        completion = output.outputs[0]
        span.set_attribute("gen_ai.usage.output_tokens", generated)
        log.info("%s %s: %d prompt tokens, %d generated, %s", self.role.name,
                 request.request_id, len(request.prompt_token_ids), generated,
                 completion.finish_reason)  # fmt: skip
        if completion.finish_reason == "error":
            raise self.role.failure(request)
        finish.reason = _FINISH.get(completion.finish_reason or "", common_pb2.FINISH_REASON_STOP)
        self.role.hand_off(request.request_id, output, layouts, finish)

    def in_flight(self) -> int:
        return len(self._running)

    async def engine_problem(
        self, canary_after: float = _CANARY_AFTER_S, timeout: float = _CANARY_TIMEOUT_S
    ) -> str:
        """Why the live engine cannot generate, or "" when it can: after `canary_after`
        seconds without an output, a one-token request on a one-token prompt must finish
        within `timeout`. A wedged engine fails the canary; a busy one passes without it."""
        if time.monotonic() - self._last_output < canary_after:
            return ""
        canary = TokensPrompt(prompt_token_ids=[0])
        params = SamplingParams(max_tokens=1, detokenize=False)
        try:
            async with asyncio.timeout(timeout):
                async for _ in self.engine.generate(canary, params, f"prism-canary-{uuid4()}"):
                    pass
        except TimeoutError:
            return f"its engine did not generate a token in {timeout:.0f} s"
        except Exception as exc:
            return f"its engine failed a request ({exc!r})"
        self._last_output = time.monotonic()
        return ""

    async def watch(self, server: Server, period: float = _WATCH_S) -> None:
        """Keeps the health status true to whether the engine can generate, as Dynamo's
        canary checks do: a server that answers while its engine cannot generate would
        keep taking requests from routing and Consul."""
        serving = True
        while True:
            await asyncio.sleep(period)
            try:
                await self.engine.check_health()
            except EngineDeadError as exc:
                # Nothing brings a dead engine core back: NOT_SERVING now, then the
                # stage drains and exits, and its supervisor starts it again.
                await server.set_serving([self.service.name], False)
                raise RuntimeError("its vLLM engine core died (EngineDeadError)") from exc
            problem = await self.engine_problem()
            if bool(problem) == serving:
                serving = not problem
                log.warning("worker (%s): %s", self.role.name, f"NOT_SERVING: {problem}"
                            if problem else "SERVING again")  # fmt: skip
                await server.set_serving([self.service.name], serving)

    async def abort(
        self, request: engine_pb2.EngineServiceAbortRequest
    ) -> engine_pb2.EngineServiceAbortResponse:
        running = request.request_id in self._running
        if running:
            self._running[request.request_id] = True
            await self.engine.abort(request.request_id)
        released = self.role.release(request.request_id)
        return engine_pb2.EngineServiceAbortResponse(aborted=running or released)
