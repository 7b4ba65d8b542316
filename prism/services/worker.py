"""The worker stage: `EngineService` on one vLLM `AsyncLLM`, in one role.

The worker takes token ids (never text) and streams token ids back; templating,
detokenization and stop strings are the processor's. Cancelling a `Generate` call, or
`Abort`, aborts the request inside vLLM so its KV blocks are freed at once.

The prefill roles run the prompt with one output token and hand back, with that token,
where the prompt's KV cache waits (vLLM's NixlConnector) and how each image was laid out
in the prompt; the decode role reads that cache and generates the answer. The processor
carries both from one to the other.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any
from uuid import uuid4

import grpc
import torch
from opentelemetry.trace import Span
from vllm import SamplingParams, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from prism import kv_transfer, logs, multiplex, rpc, telemetry, tracing
from prism.media import decode_image
from prism.modes import MESH_ROLE, modes_served
from prism.registry import instance, open_registry
from prism.rpc import PrismError, invalid
from prism.sampling import to_vllm
from prism.services.engine import start_engine
from prism.tracing import tracer
from prism.transfer import TransferAgent, TransferError
from prism.v1 import common_pb2, encoder_pb2, engine_pb2, engine_pb2_grpc, errors_pb2

log = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


PREFILL_ROLES = ("prefill", "encode_prefill")
# The span of a request's work in the engine, by role.
_SPAN_NAME = {"aggregated": "generate", "prefill": "prefill", "encode_prefill": "prefill",
              "decode": "decode"}  # fmt: skip
# Longest pause between tries to free a prefill's KV that the connector does not hold yet.
_RELEASE_POLL_MAX_S = 0.25
# The engine's health: checked this often; after this long without an output a one-token
# canary proves it still generates, and fails past its timeout.
_WATCH_S = 2.0
_CANARY_AFTER_S = 10.0
_CANARY_TIMEOUT_S = 5.0


def embeddings_input(tensors: list[torch.Tensor], grids: Sequence[Sequence[int]]) -> object:
    """Precomputed embeddings in the form vLLM takes for the model's family."""
    if any(grids):
        # Qwen2-VL: one (tokens, hidden) block for all images, and each image's grid.
        grid = torch.tensor([list(thw) for thw in grids])
        return {"image_embeds": torch.cat(tensors), "image_grid_thw": grid}
    if len({tensor.shape for tensor in tensors}) == 1:
        # A 3-D tensor is read as (images, tokens, hidden); a 2-D one would be many images.
        return torch.stack(tensors)
    return tensors


def image_layouts(engine_input: Mapping[str, Any]) -> list[engine_pb2.ImageLayout]:
    """How vLLM laid out each image of a rendered prompt: what a decode engine needs."""
    if engine_input.get("type") != "multimodal":
        return []
    layouts = []
    items = engine_input["mm_kwargs"].get("image", [])
    hashes = engine_input["mm_hashes"].get("image", [])
    for index, placeholder in enumerate(engine_input["mm_placeholders"].get("image", [])):
        item = items[index]
        grid = item["image_grid_thw"].data.tolist() if "image_grid_thw" in item else []
        layouts.append(
            engine_pb2.ImageLayout(
                uuid=hashes[index], num_tokens=placeholder.length, image_grid_thw=grid
            )
        )
    return layouts


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(
        self,
        engine: AsyncLLM,
        role: str,
        transfer: TransferAgent | None = None,
        kv_lease_s: float = 30.0,
        max_in_flight: int = 0,
    ):
        self.engine = engine
        self.limit = rpc.InFlightLimit(max_in_flight)
        self.role = role
        self.transfer = transfer
        self.kv_lease_s = kv_lease_s
        # Running request ids -> whether an Abort came for them.
        self._running: dict[str, bool] = {}
        # Prefill roles: request id -> (engine request id, end of lease) while its KV
        # cache waits for a decode.
        self._held: dict[str, tuple[str, float]] = {}
        self._releases: set[asyncio.Task] = set()
        # When the engine last produced an output: traffic proves it generates.
        self._last_output = time.monotonic()
        self.batches = multiplex.Server(
            f"/{SERVICE}/Generate",
            self._admitted,
            engine_pb2.GenerateBatchResponse,
            engine_pb2.GenerateEvent,
        )

    @staticmethod
    def _decode_images(images: list[common_pb2.Image]) -> list:
        decoded = []
        for index, image in enumerate(images):
            try:
                decoded.append(decode_image(image.data))
            except ValueError as exc:
                raise invalid(str(exc), param=f"images[{index}]") from None
        return decoded

    async def _fetch(self, handles: Sequence[encoder_pb2.EmbeddingHandle]) -> object:
        if self.transfer is None:
            raise invalid("this worker takes images, not embeddings", "image_embeddings")
        transfer = self.transfer

        def read(handle: encoder_pb2.EmbeddingHandle) -> torch.Tensor:
            with tracer.start_as_current_span("nixl.read") as span:
                start = time.perf_counter()
                tensor = transfer.fetch(handle.embeddings)
                seconds = time.perf_counter() - start
                telemetry.NIXL_READ_SECONDS.labels("embeddings").observe(seconds)
                span.set_attributes({
                    "prism.nixl.bytes": tensor.numel() * tensor.element_size(),
                    "prism.nixl.seconds": seconds,
                    "prism.nixl.peer": handle.embeddings.agent_name,
                })  # fmt: skip
                return tensor

        try:
            tensors = await asyncio.gather(*(asyncio.to_thread(read, h) for h in handles))
        except TransferError as exc:
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                f"image embeddings could not be read: {exc}",
                reason=errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE,
                param="image_embeddings",
            ) from None
        return embeddings_input(list(tensors), [h.image_grid_thw for h in handles])

    def _placeholders(self, layouts: Sequence[engine_pb2.ImageLayout]) -> object:
        """Zero embeddings shaped like prefill's: they are never read, since the images'
        KV comes from prefill, but they make vLLM lay out the prompt the same way."""
        config = self.engine.model_config
        hidden = config.get_inputs_embeds_size()
        tensors = [torch.zeros(layout.num_tokens, hidden, dtype=config.dtype) for layout in layouts]
        return embeddings_input(tensors, [layout.image_grid_thw for layout in layouts])

    def _params(self, request: engine_pb2.GenerateRequest) -> SamplingParams:
        # Stop strings need text: the processor applies them, the engine never sees them.
        common: dict[str, Any] = dict(
            stop=None, detokenize=False, output_kind=RequestOutputKind.DELTA
        )
        if self.role in PREFILL_ROLES:
            # One token, then the KV cache waits for a decode worker. min_tokens still
            # bars end-of-sequence from that token as it would in one engine.
            return to_vllm(
                request.sampling,
                **common,
                max_tokens=1,
                min_tokens=min(request.sampling.min_tokens, 1),
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
            )
        if self.role == "decode":
            if not request.HasField("kv_transfer_params"):
                raise invalid("a decode worker needs kv_transfer_params", "kv_transfer_params")
            kv_params = kv_transfer.to_vllm(request.kv_transfer_params)
            return to_vllm(request.sampling, **common, extra_args={"kv_transfer_params": kv_params})
        if request.HasField("kv_transfer_params"):
            raise invalid("an aggregated worker takes no kv_transfer_params", "kv_transfer_params")
        return to_vllm(request.sampling, **common)

    async def _prompt(self, request: engine_pb2.GenerateRequest) -> TokensPrompt:
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        given = [f for f in ("images", "image_embeddings", "image_layouts") if getattr(request, f)]
        if len(given) > 1:
            raise invalid(f"send one of images, image_embeddings, image_layouts, not {given}")
        if request.images:
            images = await asyncio.to_thread(self._decode_images, list(request.images))
            prompt["multi_modal_data"] = {"image": images}
        elif request.image_embeddings:
            prompt["multi_modal_data"] = {"image": await self._fetch(request.image_embeddings)}
        elif request.image_layouts:
            if self.role != "decode":
                raise invalid("only a decode worker takes image_layouts", "image_layouts")
            layouts = request.image_layouts
            prompt["multi_modal_data"] = {"image": self._placeholders(layouts)}
            # The image's identity keeps decode's prefix cache from mixing up images whose
            # placeholders look alike.
            prompt["multi_modal_uuids"] = {"image": [layout.uuid or None for layout in layouts]}
        return prompt

    def _finish_reason(self, reason: str | None, request: engine_pb2.GenerateRequest) -> int:
        if reason == "error":
            if self.role == "decode":
                kv = request.kv_transfer_params
                raise PrismError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the prompt's KV cache could not be read from the prefill engine "
                    f"{kv.remote_engine_id} at {kv.remote_host}:{kv.remote_port}",
                    reason=errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
                    param="kv_transfer_params",
                )
            raise PrismError(grpc.StatusCode.INTERNAL, "the engine failed the request")
        return _FINISH.get(reason or "", common_pb2.FINISH_REASON_STOP)

    @rpc.rpc_errors
    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        async for reply in self._admitted(request):
            yield reply

    async def GenerateBatch(
        self,
        request_iterator: AsyncIterator[engine_pb2.GenerateBatchRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[engine_pb2.GenerateBatchResponse]:
        async for batch in self.batches.serve(request_iterator):
            yield batch

    async def _admitted(
        self, request: engine_pb2.GenerateRequest
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        with self.limit.admit():
            async for reply in self._generate(request):
                yield reply

    async def _generate(
        self, request: engine_pb2.GenerateRequest
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        if not request.request_id:
            raise invalid("request_id is required", "request_id")
        if not request.prompt_token_ids:
            raise invalid("prompt_token_ids is empty", "prompt_token_ids")
        params = self._params(request)
        prompt = await self._prompt(request)
        request_id = request.request_id
        self._running[request_id] = False
        first = True
        span: Span | None = None
        try:
            engine_input: Any = prompt
            layouts: list[engine_pb2.ImageLayout] = []
            if self.role in PREFILL_ROLES and "multi_modal_data" in prompt:
                # Rendered here rather than inside generate() to learn the image layouts.
                (engine_input,) = await self.engine.renderer.render_cmpl_async(
                    [prompt], skip_mm_cache=True
                )
                layouts = image_layouts(engine_input)
            # Not made current: this generator yields, and may be closed from another
            # task, where a context attached here could not be detached.
            span = tracer.start_span(_SPAN_NAME[self.role])
            span.set_attributes({
                "prism.request_id": logs.REQUEST_ID.get(),
                "prism.engine_request_id": request_id,
            })  # fmt: skip
            generated = 0
            async for output in self.engine.generate(engine_input, params, request_id):
                self._last_output = time.monotonic()
                completion = output.outputs[0]
                generated += len(completion.token_ids)
                reply = engine_pb2.GenerateResponse(token_ids=completion.token_ids)
                if first:
                    reply.prompt_tokens = len(output.prompt_token_ids or ())
                    reply.cached_tokens = output.num_cached_tokens or 0
                    span.set_attributes({
                        "gen_ai.usage.input_tokens": reply.prompt_tokens,
                        "prism.cached_tokens": reply.cached_tokens,
                    })  # fmt: skip
                    first = False
                if output.finished:
                    span.set_attribute("gen_ai.usage.output_tokens", generated)
                    log.info("%s %s: %d prompt tokens, %d generated, %s", self.role,
                             request_id, len(request.prompt_token_ids), generated,
                             completion.finish_reason)  # fmt: skip
                    reply.finish_reason = self._finish_reason(completion.finish_reason, request)
                    if output.kv_transfer_params and self.role in PREFILL_ROLES:
                        reply.kv_transfer_params.CopyFrom(
                            kv_transfer.to_proto(output.kv_transfer_params)
                        )
                        reply.image_layouts.extend(layouts)
                        self._hold(request_id, output.kv_transfer_params["remote_request_id"])
                yield reply
                if self._running.get(request_id) and not output.finished:
                    # vLLM drops an abort that comes before it knows the request: repeat it.
                    await self.engine.abort(request_id)
        except (ValueError, VLLMClientError) as exc:
            # vLLM rejects bad prompts (too long, image count) with these.
            raise invalid(str(exc), param=getattr(exc, "parameter", None)) from None
        finally:
            if span is not None:
                span.end()
            self._running.pop(request_id, None)

    def in_flight(self) -> int:
        return len(self._running)

    async def engine_problem(
        self, canary_after: float = _CANARY_AFTER_S, timeout: float = _CANARY_TIMEOUT_S
    ) -> str:
        """Why the engine cannot generate, or "" when it can: its core must be alive
        (vLLM's own check) and, after `canary_after` seconds without an output, a
        one-token request on a one-token prompt must finish within `timeout`. A wedged
        engine fails the canary; a busy one passes without it."""
        try:
            await self.engine.check_health()
        except Exception as exc:
            return f"its engine is dead ({exc!r})"
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

    async def watch(self, server: rpc.Server, period: float = _WATCH_S) -> None:
        """Keeps the health status true to whether the engine can generate, as Dynamo's
        canary checks do: a server that answers while its engine cannot generate would
        keep taking requests from routing and Consul."""
        serving = True
        while True:
            await asyncio.sleep(period)
            problem = await self.engine_problem()
            if bool(problem) == serving:
                serving = not problem
                log.warning("worker (%s): %s", self.role, f"NOT_SERVING: {problem}"
                            if problem else "SERVING again")  # fmt: skip
                await server.set_serving([SERVICE], serving)

    def _hold(self, request_id: str, engine_request_id: str) -> None:
        now = time.monotonic()
        for stale in [k for k, (_, until) in self._held.items() if until <= now]:
            del self._held[stale]
        self._held[request_id] = (engine_request_id, now + self.kv_lease_s)

    def _release(self, request_id: str) -> bool:
        """Starts freeing the KV cache a prefill holds for `request_id`; False if none."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        task = asyncio.create_task(self._end_lease(*held))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return True

    async def _end_lease(self, engine_request_id: str, until: float) -> None:
        # The connector learns of a finished request at the engine's next step, which a
        # busy machine may delay: keep trying, less often, until the lease would end anyway.
        pause = 0.02
        while time.monotonic() < until:
            (release,) = await self.engine.collective_rpc(
                "prism_release_kv", args=(engine_request_id,)
            )
            if release != "pending":
                return
            await asyncio.sleep(pause)
            pause = min(pause * 2, _RELEASE_POLL_MAX_S)

    @rpc.rpc_errors
    async def Abort(
        self, request: engine_pb2.EngineServiceAbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineServiceAbortResponse:
        running = request.request_id in self._running
        if running:
            self._running[request.request_id] = True
            await self.engine.abort(request.request_id)
        released = self._release(request.request_id)
        return engine_pb2.EngineServiceAbortResponse(aborted=running or released)


async def serve(args: argparse.Namespace) -> None:
    tracing.setup(MESH_ROLE[args.role])
    engine = start_engine(args)
    reads_embeddings = args.enable_mm_embeds or args.role == "prefill"
    transfer = TransferAgent(pool_bytes=args.pool_mib * 2**20) if reads_embeddings else None
    servicer = EngineServicer(engine, args.role, transfer, args.kv_lease_s, args.max_in_flight)
    server = await rpc.start_server(
        f"{args.host}:{args.port}",
        lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, s),
        [SERVICE],
        in_flight=servicer.in_flight,
    )
    collectors = [telemetry.transfer_collector(transfer)] if transfer else []
    collectors.append(
        telemetry.gauge(
            "prism_engine_requests_in_flight", "Requests this worker runs", servicer.in_flight
        )
    )
    telemetry.serve_metrics(args.metrics_port, args.host, collectors)
    await server.set_serving([SERVICE])
    watcher = asyncio.create_task(servicer.watch(server))
    log.info("worker (%s) serving %s on %s:%d", args.role, args.model, args.host, server.port)
    if args.role != "aggregated":
        log.info("worker (%s) KV side channel on %s:%d", args.role, args.kv_host, args.kv_port)
    registry = open_registry(args)
    modes = modes_served(args.role, args.enable_mm_embeds)
    await registry.register(instance(args, MESH_ROLE[args.role], server.port, modes))

    async def drain() -> None:
        servicer.batches.drain()
        await registry.deregister()

    try:
        await rpc.wait_for_termination(
            server, [SERVICE], grace=args.shutdown_grace_s, on_drain=drain
        )
    finally:
        watcher.cancel()
        await registry.close()
        engine.shutdown()
        if transfer is not None:
            transfer.close()
