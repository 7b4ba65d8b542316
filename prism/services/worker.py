"""The worker stage: `EngineService` on one vLLM `AsyncLLM`.

The worker takes token ids (never text) and streams token ids back; templating,
detokenization and stop strings are the processor's. Cancelling a `Generate` call, or
`Abort`, aborts the request inside vLLM so its KV blocks are freed at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
import torch
from vllm import AsyncEngineArgs, TokensPrompt
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from prism import rpc, telemetry
from prism.media import decode_image
from prism.rpc import PrismError, invalid
from prism.sampling import to_vllm
from prism.transfer import TransferAgent, TransferError
from prism.v1 import common_pb2, encoder_pb2, engine_pb2, engine_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def engine_args(args: argparse.Namespace) -> AsyncEngineArgs:
    return AsyncEngineArgs(
        enable_mm_embeds=args.enable_mm_embeds,
        model=args.model,
        served_model_name=args.served_model_name or None,
        dtype=args.dtype,
        max_model_len=args.max_model_len or None,
        limit_mm_per_prompt={"image": args.max_images},
        enforce_eager=True,
        enable_log_requests=False,
        disable_log_stats=False,
        seed=args.seed,
    )


def embeddings_input(
    handles: list[encoder_pb2.EmbeddingHandle], tensors: list[torch.Tensor]
) -> object:
    """Precomputed embeddings in the form vLLM takes for the model's family."""
    if any(handle.image_grid_thw for handle in handles):
        # Qwen2-VL: one (tokens, hidden) block for all images, and each image's grid.
        grid = torch.tensor([list(handle.image_grid_thw) for handle in handles])
        return {"image_embeds": torch.cat(tensors), "image_grid_thw": grid}
    if len({tensor.shape for tensor in tensors}) == 1:
        # A 3-D tensor is read as (images, tokens, hidden); a 2-D one would be many images.
        return torch.stack(tensors)
    return tensors


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncLLM, role: str, transfer: TransferAgent | None = None):
        self.engine = engine
        self.role = role
        self.transfer = transfer
        # Running request ids -> whether an Abort came for them.
        self._running: dict[str, bool] = {}

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
        try:
            tensors = await asyncio.gather(
                *(asyncio.to_thread(transfer.fetch, h.embeddings) for h in handles)
            )
        except TransferError as exc:
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                f"image embeddings could not be read: {exc}",
                reason="EMBEDDINGS_UNAVAILABLE",
                param="image_embeddings",
            ) from None
        return embeddings_input(list(handles), list(tensors))

    @rpc.rpc_errors
    async def Generate(
        self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        if not request.request_id:
            raise invalid("request_id is required", "request_id")
        if not request.prompt_token_ids:
            raise invalid("prompt_token_ids is empty", "prompt_token_ids")
        # Stop strings need text: the processor applies them, the engine never sees them.
        params = to_vllm(
            request.sampling, stop=None, detokenize=False, output_kind=RequestOutputKind.DELTA
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        if request.images and request.image_embeddings:
            raise invalid("send images or image_embeddings, not both", "image_embeddings")
        if request.images:
            images = await asyncio.to_thread(self._decode_images, list(request.images))
            prompt["multi_modal_data"] = {"image": images}
        elif request.image_embeddings:
            prompt["multi_modal_data"] = {"image": await self._fetch(request.image_embeddings)}
        self._running[request.request_id] = False
        first = True
        try:
            async for output in self.engine.generate(prompt, params, request.request_id):
                completion = output.outputs[0]
                reply = engine_pb2.GenerateResponse(token_ids=completion.token_ids)
                if first:
                    reply.prompt_tokens = len(output.prompt_token_ids or ())
                    reply.cached_tokens = output.num_cached_tokens or 0
                    first = False
                if output.finished:
                    reply.finish_reason = _FINISH.get(
                        completion.finish_reason or "", common_pb2.FINISH_REASON_STOP
                    )
                yield reply
                if self._running.get(request.request_id) and not output.finished:
                    # vLLM drops an abort that comes before it knows the request: repeat it.
                    await self.engine.abort(request.request_id)
        except (ValueError, VLLMClientError) as exc:
            # vLLM rejects bad prompts (too long, image count) with these.
            raise invalid(str(exc), param=getattr(exc, "parameter", None)) from None
        finally:
            self._running.pop(request.request_id, None)

    @rpc.rpc_errors
    async def Abort(
        self, request: engine_pb2.EngineServiceAbortRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineServiceAbortResponse:
        running = request.request_id in self._running
        if running:
            self._running[request.request_id] = True
            await self.engine.abort(request.request_id)
        return engine_pb2.EngineServiceAbortResponse(aborted=running)


async def serve(args: argparse.Namespace) -> None:
    engine = AsyncLLM.from_engine_args(engine_args(args))
    transfer = TransferAgent(pool_bytes=args.pool_mib * 2**20) if args.enable_mm_embeds else None
    servicer = EngineServicer(engine, args.role, transfer)
    server = await rpc.start_server(
        f"{args.host}:{args.port}",
        lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, s),
        [SERVICE],
    )
    collectors = [telemetry.transfer_collector(transfer)] if transfer else []
    telemetry.serve_metrics(args.metrics_port, args.host, collectors)
    await server.set_serving([SERVICE])
    log.info("worker (%s) serving %s on %s:%d", args.role, args.model, args.host, server.port)
    try:
        await rpc.wait_for_termination(server, [SERVICE])
    finally:
        engine.shutdown()
        if transfer is not None:
            transfer.close()
