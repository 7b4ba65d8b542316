"""The handlers of `GRPCInferenceService` over the processor, and the port that serves
them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from importlib.metadata import version
from typing import Any

import grpc

from prism import logs, telemetry, tracing
from prism.gateway.client import ProcessorClient
from prism.gateway.kserve.inference import Answer, Generation, generation
from prism.gateway.kserve.tensors import CONFIG_TYPES, INPUTS, OUTPUTS
from prism.proto.kserve import grpc_service_pb2 as kserve
from prism.proto.kserve import grpc_service_pb2_grpc as kserve_grpc
from prism.proto.v1 import errors_pb2
from prism.rpc.errors import PrismError, invalid, status_for
from prism.rpc.server import InFlightLimit, Server, start_server

log = logging.getLogger(__name__)

SERVICE = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
VERSION = "1"


def _final(response: kserve.ModelInferResponse, final: bool) -> kserve.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


class KServe:
    """The handlers of GRPCInferenceService. `authorize` checks a call's `authorization`
    metadata; `limit` is the gateway's bound on generations in flight, shared with REST."""

    def __init__(
        self,
        processor: ProcessorClient,
        limit: InFlightLimit,
        authorize: Callable[[str], None],
    ) -> None:
        self.processor = processor
        self.limit = limit
        self.authorize = authorize

    # Health: no API key, as REST's /health.
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve.ServerReadyResponse(ready=await self.processor.healthy())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            ready = request.name in await self._models()
        except PrismError:
            ready = False
        return kserve.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ServerMetadata"):
            return kserve.ServerMetadataResponse(name="prism", version=version("prism-mesh"))

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ModelMetadata"):
            await self._check_model(request.name, request.version)
            meta = kserve.ModelMetadataResponse.TensorMetadata
            return kserve.ModelMetadataResponse(
                name=request.name,
                versions=[VERSION],
                platform="prism",
                inputs=[meta(name=t.name, datatype=t.datatype, shape=t.shape)
                        for t in INPUTS.values()],
                outputs=[meta(name=t.name, datatype=t.datatype, shape=t.shape)
                         for t in OUTPUTS.values()],
            )  # fmt: skip

    async def ModelConfig(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with self._call(context, "ModelConfig"):
            await self._check_model(request.name, request.version)
            config = kserve.ModelConfig(
                name=request.name,
                platform="prism",
                backend="prism",
                max_batch_size=0,
                input=[kserve.ModelInput(name=t.name, data_type=CONFIG_TYPES[t.datatype],
                                         dims=t.shape, optional=t.optional)
                       for t in INPUTS.values()],
                output=[kserve.ModelOutput(name=t.name, data_type=CONFIG_TYPES[t.datatype],
                                           dims=t.shape) for t in OUTPUTS.values()],
                model_transaction_policy=kserve.ModelTransactionPolicy(decoupled=True),
            )  # fmt: skip
            return kserve.ModelConfigResponse(config=config)

    async def ModelInfer(
        self, request: kserve.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> kserve.ModelInferResponse:
        async with self._call(context, "ModelInfer", request.id):
            wanted = generation(request)
            if wanted.stream:
                raise invalid("stream = true needs the streaming ModelStreamInfer", "stream")
            responses = [r async for r in self._generate(request, wanted)]
            return responses[-1]

    async def ModelStreamInfer(
        self, requests: AsyncIterator[kserve.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        """Requests run at once, each answered as it goes; one's failure is its error
        response. The client closing the stream cancels every request on it."""
        try:
            self.authorize(_authorization(context))
        except PrismError as error:
            await context.abort_with_status(error.to_status())
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        done = object()

        async def answer(request: kserve.ModelInferRequest) -> None:
            try:
                async with self._call(None, "ModelStreamInfer", request.id):
                    wanted = generation(request)
                    async for response in self._generate(request, wanted):
                        queue.put_nowait(kserve.ModelStreamInferResponse(infer_response=response))
            except PrismError as error:
                failed = kserve.ModelInferResponse(
                    model_name=request.model_name, model_version=VERSION, id=request.id
                )
                queue.put_nowait(kserve.ModelStreamInferResponse(
                    error_message=error.message, infer_response=_final(failed, True)
                ))  # fmt: skip

        async def read() -> None:
            async for request in requests:
                task = asyncio.create_task(answer(request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*list(tasks), return_exceptions=True)
            queue.put_nowait(done)

        reader = asyncio.create_task(read())
        try:
            while (item := await queue.get()) is not done:
                yield item
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _generate(
        self, request: kserve.ModelInferRequest, wanted: Generation
    ) -> AsyncIterator[kserve.ModelInferResponse]:
        """The responses to one request: one per message when streamed (each with that
        message's text and tokens), else one with the whole answer."""
        endpoint = "ModelStreamInfer" if wanted.stream else "ModelInfer"
        with self.limit.admit():
            timer = telemetry.RequestTimer(endpoint)
            call = self.processor.complete(wanted.request)
            whole = Answer(wanted.choices)
            whole.texts = [wanted.echo] * wanted.choices
            finished = 0
            try:
                async for message in call:
                    timer.reply(message)
                    finished += bool(message.finish_reason)
                    if not wanted.stream:
                        whole.add(message)
                        continue
                    step = Answer(wanted.choices)
                    step.add(message)
                    # As Triton marks a decoupled model's last response: here the one that
                    # ends the last choice.
                    last = finished == wanted.choices and not wanted.empty_final
                    yield self._response(request, step, wanted.outputs, final=last)
            except grpc.aio.AioRpcError as exc:
                raise PrismError.from_rpc_error(exc) from None
            finally:
                call.cancel()
                timer.finish(finished == wanted.choices)
            if not wanted.stream:
                yield self._response(request, whole, wanted.outputs, final=None)
            elif wanted.empty_final:
                yield self._response(request, None, [], final=True)

    @staticmethod
    def _response(
        request: kserve.ModelInferRequest,
        answer: Answer | None,
        outputs: list[str],
        final: bool | None,
    ) -> kserve.ModelInferResponse:
        response = kserve.ModelInferResponse(
            model_name=request.model_name, model_version=VERSION, id=request.id
        )
        if answer is not None:
            tensors, raw = answer.tensors(outputs)
            response.outputs.extend(tensors)
            response.raw_output_contents.extend(raw)
        return response if final is None else _final(response, final)

    async def _models(self) -> list[str]:
        try:
            reply = await self.processor.list_models(timeout=5)
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        return [model.id for model in reply.models]

    async def _check_model(self, name: str, version: str) -> None:
        if name not in await self._models() or version not in ("", VERSION):
            raise PrismError(
                grpc.StatusCode.NOT_FOUND,
                f"Request for unknown model: '{name}' version '{version or VERSION}' is not found",
                reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
            )

    @contextlib.asynccontextmanager
    async def _call(
        self, context: grpc.aio.ServicerContext | None, method: str, request_id: str = ""
    ) -> AsyncIterator[None]:
        """One call: its id (the client's `x-request-id`, else the request's own `id` where
        it is a sane one; a unary call answers it in its metadata), the API key, its count
        by status; an error ends a unary call with its status, and goes on to a stream's own
        handling."""
        if context is not None:
            metadata = dict(context.invocation_metadata() or ())
            request_id = metadata.get(logs.HEADER, "") or request_id
        if not logs.CLIENT_ID.fullmatch(request_id or ""):
            request_id = uuid.uuid4().hex
        token = logs.REQUEST_ID.set(request_id)
        status = grpc.StatusCode.OK
        start = time.perf_counter()
        try:
            if context is not None:
                # As REST's response header: the id to find this call in the logs by.
                await context.send_initial_metadata(((logs.HEADER, request_id),))
                self.authorize(_authorization(context))
            yield
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            error = status_for(exc)
            status = error.code
            if context is None:
                raise error from None
            await context.abort_with_status(error.to_status())
        finally:
            telemetry.REQUESTS.labels(method, status.name).inc()
            log.info("kserve %s %s: %s after %.3f s", method, request_id, status.name,
                     time.perf_counter() - start)  # fmt: skip
            logs.REQUEST_ID.reset(token)


def _authorization(context: grpc.aio.ServicerContext) -> str:
    return dict(context.invocation_metadata() or ()).get("authorization", "")


async def start(
    address: str,
    processor: ProcessorClient,
    limit: InFlightLimit,
    authorize: Callable[[str], None],
    reuse_port: bool = False,
) -> Server:
    """Serves KServe v2 at `address`, with health (in step with the gateway's) and
    reflection, as every stage's port has them; shared with other processes only with
    `reuse_port`."""
    servicer = KServe(processor, limit, authorize)
    return await start_server(
        address,
        lambda server: kserve_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server),
        [SERVICE],
        interceptors=tracing.server_interceptors("gateway"),
        door="KServe gRPC",
        reuse_port=reuse_port,
    )
