"""KServe v2 gRPC (`inference.GRPCInferenceService`, as Triton serves it) over the
processor, with the tensors of Triton's vLLM backend, so that client code written for
Triton + vLLM works unchanged.

A request is a completion of a raw prompt, as in that backend: `text_input` is the prompt
as given (no chat template), with the model's image placeholder once for each `image`
(base64 JPEG or PNG); `sampling_parameters` is a JSON object of vLLM's sampling parameters
(values as JSON or as strings, as Triton clients send them); `stream` asks for one
response per delta (ModelStreamInfer only); without `exclude_input_in_output`, an answer
that is not streamed starts with the prompt. `return_finish_reason`,
`return_num_input_tokens` and `return_num_output_tokens` add those outputs.

The same front door as REST: the API key (metadata `authorization: Bearer KEY`), the
bound on generations in flight, the request deadline, request ids, metrics and spans.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import grpc

from prism import logs, rpc, telemetry, tracing
from prism.gateway import translate
from prism.kserve import grpc_service_pb2 as kserve
from prism.kserve import grpc_service_pb2_grpc as kserve_grpc
from prism.rpc import PrismError, invalid
from prism.v1 import common_pb2, errors_pb2, inference_pb2

if TYPE_CHECKING:
    from prism.gateway.app import Gateway

log = logging.getLogger(__name__)

SERVICE = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
VERSION = "1"


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = True


# As Triton's vLLM backend declares them (its auto-completed config).
INPUTS = {
    t.name: t
    for t in (
        Tensor("text_input", "BYTES", (1,), optional=False),
        Tensor("image", "BYTES", (-1,)),
        Tensor("stream", "BOOL", (1,)),
        Tensor("sampling_parameters", "BYTES", (1,)),
        Tensor("exclude_input_in_output", "BOOL", (1,)),
        Tensor("return_finish_reason", "BOOL", (1,)),
        Tensor("return_num_input_tokens", "BOOL", (1,)),
        Tensor("return_num_output_tokens", "BOOL", (1,)),
    )
}
OUTPUTS = {
    t.name: t
    for t in (
        Tensor("text_output", "BYTES", (-1,)),
        Tensor("finish_reason", "BYTES", (-1,)),
        Tensor("num_input_tokens", "UINT32", (1,)),
        Tensor("num_output_tokens", "UINT32", (-1,)),
    )
}
_CONFIG_TYPES = {"BYTES": kserve.TYPE_STRING, "BOOL": kserve.TYPE_BOOL,
                 "UINT32": kserve.TYPE_UINT32}  # fmt: skip
# Sampling parameters that Triton clients send as strings, by the type vLLM gives them.
_INTS = {"top_k", "max_tokens", "min_tokens", "seed", "n"}
_BOOLS = {"ignore_eos", "include_stop_str_in_output", "skip_special_tokens"}


def _unpack_bytes(raw: bytes, name: str) -> list[bytes]:
    """BYTES elements as KServe lays them out: each its length (4 bytes, little-endian),
    then its bytes."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise invalid(f"input '{name}': truncated BYTES element", name)
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise invalid(f"input '{name}': truncated BYTES element", name)
        elements.append(raw[offset : offset + size])
        offset += size
    return elements


def _pack_bytes(elements: Iterable[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def read_inputs(request: kserve.ModelInferRequest) -> dict[str, list]:
    """Each input's elements (bytes or bools), checked against the vLLM backend's tensors."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise invalid("raw_input_contents must hold the data of every input, or of none")
    values: dict[str, list] = {}
    for index, tensor in enumerate(request.inputs):
        spec = INPUTS.get(tensor.name)
        if spec is None:
            raise invalid(
                f"unexpected inference input '{tensor.name}'; the model takes " + ", ".join(INPUTS),
                tensor.name,
            )
        if tensor.name in values:
            raise invalid(f"input '{tensor.name}' is given twice", tensor.name)
        if tensor.datatype != spec.datatype:
            raise invalid(
                f"input '{tensor.name}' must be {spec.datatype}, got {tensor.datatype or 'none'}",
                tensor.name,
            )
        if raw:
            data = raw[index]
            elements = (
                _unpack_bytes(data, tensor.name) if spec.datatype == "BYTES"
                else [b != 0 for b in data]
            )  # fmt: skip
        else:
            contents = tensor.contents
            elements = list(
                contents.bytes_contents if spec.datatype == "BYTES" else contents.bool_contents
            )
        count = 1
        for dim in tensor.shape:
            count *= dim
        if count != len(elements) or any(dim < 0 for dim in tensor.shape):
            raise invalid(
                f"input '{tensor.name}' has shape {list(tensor.shape)} but "
                f"{len(elements)} elements",
                tensor.name,
            )
        if spec.shape == (1,) and len(elements) != 1:
            raise invalid(f"input '{tensor.name}' takes one element", tensor.name)
        values[tensor.name] = elements
    if "text_input" not in values:
        raise invalid("input 'text_input' is required", "text_input")
    return values


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise invalid(f"input '{name}' is not UTF-8 text", name) from None


def _sampling_body(text: str) -> dict[str, Any]:
    """`sampling_parameters` as a request body that translate.sampling reads."""
    try:
        params = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        message = f"sampling_parameters is not valid JSON: {exc}"
        raise invalid(message, "sampling_parameters") from None
    if not isinstance(params, dict):
        raise invalid("sampling_parameters must be a JSON object", "sampling_parameters")
    body: dict[str, Any] = {}
    for key, value in params.items():
        if key not in translate.SAMPLING_KEYS:
            raise invalid(f"unsupported sampling parameter '{key}'", key)
        if isinstance(value, str) and key in _INTS | _BOOLS | set(translate.FLOAT_RANGES):
            value = _from_string(key, value)
        elif isinstance(value, str) and key == "structured_outputs":
            value = translate.json_text(value, key)
        body[key] = value
    return body


def _from_string(key: str, value: str) -> int | float | bool:
    try:
        if key in _BOOLS:
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        return int(value) if key in _INTS else float(value)
    except ValueError:
        raise invalid(f"sampling parameter '{key}' has the wrong type: {value!r}", key) from None


@dataclass
class Generation:
    """A ModelInferRequest as a completion, and what its answer is to hold."""

    request: inference_pb2.CompleteRequest
    stream: bool
    # The outputs to send, in order.
    outputs: list[str]
    choices: int = 1
    # What starts each choice's text: the prompt, where the answer includes it.
    echo: str = ""
    # Streamed: a last response without outputs marks the end (Triton's
    # `triton_enable_empty_final_response`), where otherwise the last delta's does.
    empty_final: bool = False


def generation(request: kserve.ModelInferRequest) -> Generation:
    values = read_inputs(request)

    def flag(name: str) -> bool:
        return bool(values.get(name, [False])[0])

    body = _sampling_body(_text(values["sampling_parameters"][0], "sampling_parameters")
                          if "sampling_parameters" in values else "")  # fmt: skip
    body["prompt"] = _text(values["text_input"][0], "text_input")
    if not body["prompt"]:
        raise invalid("input 'text_input' must not be empty", "text_input")
    body["model"] = request.model_name
    stream = flag("stream")
    exclude = values.get("exclude_input_in_output")
    if stream and exclude is not None and not exclude[0]:
        raise invalid(
            "when streaming, exclude_input_in_output = false is not allowed",
            "exclude_input_in_output",
        )
    message = translate.completion_request(body)
    for index, image in enumerate(values.get("image", [])):
        try:
            data = base64.b64decode(image, validate=True)
        except binascii.Error:
            raise invalid(f"image[{index}] is not valid base64", f"image[{index}]") from None
        message.images.append(common_pb2.Image(data=data))

    wanted = [o.name for o in request.outputs]
    for name in wanted:
        if name not in OUTPUTS:
            raise invalid(
                f"unexpected inference output '{name}' for model '{request.model_name}'", name
            )
    if not wanted:
        wanted = ["text_output"] + [
            name for name in ("finish_reason", "num_input_tokens", "num_output_tokens")
            if flag(f"return_{name}")
        ]  # fmt: skip
    # As the vLLM backend, which prepends the prompt as given.
    echo = "" if stream or (exclude and exclude[0]) else body["prompt"]
    empty_final = request.parameters["triton_enable_empty_final_response"].bool_param
    return Generation(message, stream, wanted, message.sampling.n or 1, echo, empty_final)


@dataclass
class Answer:
    """What the messages of a request's choices add up to, as KServe outputs."""

    choices: int
    prompt_tokens: int = 0
    texts: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.texts = [""] * self.choices
        self.tokens = [0] * self.choices
        self.reasons = [None] * self.choices

    def add(self, message: inference_pb2.CompleteResponse) -> None:
        self.prompt_tokens = message.usage.prompt_tokens
        self.texts[message.index] += message.text
        self.tokens[message.index] += len(message.token_ids)
        self.reasons[message.index] = translate.finish_reason(message.finish_reason)

    def tensors(self, outputs: list[str]) -> tuple[list, list[bytes]]:
        """The output tensors and their raw contents, in the order asked."""
        data: dict[str, tuple[list[int], bytes]] = {
            "text_output": ([self.choices], _pack_bytes(t.encode() for t in self.texts)),
            "finish_reason": ([self.choices], _pack_bytes(str(r).encode() for r in self.reasons)),
            "num_input_tokens": ([1], struct.pack("<I", self.prompt_tokens)),
            "num_output_tokens": (
                [self.choices], struct.pack(f"<{self.choices}I", *self.tokens)
            ),
        }  # fmt: skip
        tensors, raw = [], []
        for name in outputs:
            shape, contents = data[name]
            tensors.append(kserve.ModelInferResponse.InferOutputTensor(
                name=name, datatype=OUTPUTS[name].datatype, shape=shape
            ))  # fmt: skip
            raw.append(contents)
        return tensors, raw


def _final(response: kserve.ModelInferResponse, final: bool) -> kserve.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


class KServe:
    """The handlers of GRPCInferenceService. `authorize` checks a call's `authorization`
    metadata; `limit` is the gateway's bound on generations in flight, shared with REST."""

    def __init__(
        self, gateway: Gateway, limit: rpc.InFlightLimit, authorize: Callable[[str], None]
    ) -> None:
        self.gateway = gateway
        self.limit = limit
        self.authorize = authorize

    # Health: no API key, as REST's /health.
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve.ServerReadyResponse(ready=await self.gateway.healthy())

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
                input=[kserve.ModelInput(name=t.name, data_type=_CONFIG_TYPES[t.datatype],
                                         dims=t.shape, optional=t.optional)
                       for t in INPUTS.values()],
                output=[kserve.ModelOutput(name=t.name, data_type=_CONFIG_TYPES[t.datatype],
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
            call = self.gateway.complete(wanted.request)
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
        stub = self.gateway.stub()
        try:
            reply = await stub.ListModels(
                inference_pb2.ListModelsRequest(), metadata=rpc.call_metadata(), timeout=5
            )
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
            error = rpc.status_for(exc)
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
    address: str, gateway: Gateway, limit: rpc.InFlightLimit, authorize: Callable[[str], None]
) -> rpc.Server:
    """Serves KServe v2 at `address`, with health (in step with the gateway's) and
    reflection, as every stage's port has them."""
    servicer = KServe(gateway, limit, authorize)
    return await rpc.start_server(
        address,
        lambda server: kserve_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server),
        [SERVICE],
        interceptors=tracing.server_interceptors(),
    )
