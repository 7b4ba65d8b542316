"""KServe v2 requests as the gateway reads them, and answers as it lays them out: Triton's
vLLM backend tensors, in raw contents and in typed contents, without a mesh."""

import asyncio
import base64
import contextlib
import re
import struct
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from fastapi.testclient import TestClient
from support.serving import serving
from support.waiting import until, wait_for

from prism.gateway.app import create_app
from prism.gateway.kserve import inference, tensors
from prism.proto.kserve import grpc_service_pb2 as pb
from prism.proto.kserve import grpc_service_pb2_grpc as pb_grpc
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.runtime.ports import free_port
from prism.runtime.service import Service
from prism.telemetry import REQUESTS

Tensor = pb.ModelInferRequest.InferInputTensor
Stub = pb_grpc.GRPCInferenceServiceStub


def _raw_bytes(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def request(raw: bool = True, **inputs: list) -> pb.ModelInferRequest:
    """A request with `inputs` (name → elements: bytes or bools), laid out as tritonclient
    lays them out (raw) or in typed contents."""
    message = pb.ModelInferRequest(model_name="tiny", id="r1")
    for name, elements in inputs.items():
        kind = "BOOL" if isinstance(elements[0], bool) else "BYTES"
        tensor = Tensor(name=name, datatype=kind, shape=[len(elements)])
        if raw:
            data = _raw_bytes(*elements) if kind == "BYTES" else bytes(elements)
            message.raw_input_contents.append(data)
        elif kind == "BYTES":
            tensor.contents.bytes_contents.extend(elements)
        else:
            tensor.contents.bool_contents.extend(elements)
        message.inputs.append(tensor)
    return message


def error_of(message: pb.ModelInferRequest) -> PrismError:
    with pytest.raises(PrismError) as caught:
        inference.generation(message)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "contents"])
def test_a_request_becomes_a_completion_of_its_raw_prompt(raw):
    image = base64.b64encode(b"\x89PNG...")
    sampling = b'{"temperature": "0", "max_tokens": "12", "top_k": 5, "ignore_eos": "true"}'
    wanted = inference.generation(
        request(raw, text_input=[b"USER: <image> Hi"], image=[image],
                sampling_parameters=[sampling], return_num_input_tokens=[True])
    )  # fmt: skip
    sent = wanted.request
    assert (sent.text, sent.model, sent.echo) == ("USER: <image> Hi", "tiny", False)
    assert list(sent.images) == [common_pb2.Image(data=b"\x89PNG...")]
    assert (sent.sampling.temperature, sent.sampling.max_tokens, sent.sampling.top_k) == (0, 12, 5)
    assert sent.sampling.ignore_eos
    # Not streamed and not excluded: the answer starts with the prompt, as in the backend.
    assert not wanted.stream and wanted.echo == "USER: <image> Hi"
    assert wanted.outputs == ["text_output", "num_input_tokens"]


def test_streaming_excludes_the_prompt_and_refuses_to_include_it():
    wanted = inference.generation(request(text_input=[b"Hi"], stream=[True]))
    assert wanted.stream and wanted.echo == ""
    excluded = inference.generation(request(text_input=[b"Hi"], exclude_input_in_output=[True]))
    assert excluded.echo == ""
    error = error_of(request(text_input=[b"Hi"], stream=[True], exclude_input_in_output=[False]))
    assert error.param == "exclude_input_in_output"


@pytest.mark.parametrize(
    "inputs,message",
    [
        ({"prompt": [b"Hi"]}, "unexpected inference input 'prompt'"),
        # Triton's vLLM backend has no audio input: neither has this door.
        ({"text_input": [b"Hi"], "audio": [b"UklGRg=="]}, "unexpected inference input 'audio'"),
        ({"image": [b"aGk="]}, "'text_input' is required"),
        ({"text_input": [b"Hi", b"Ho"]}, "takes one element"),
        ({"text_input": [b"\xff"]}, "not UTF-8"),
        ({"text_input": [b""]}, "must not be empty"),
        ({"text_input": [b"Hi"], "image": [b"%%%"]}, r"image\[0\] is not valid base64"),
        ({"text_input": [b"Hi"], "sampling_parameters": [b"{"]}, "not valid JSON"),
        ({"text_input": [b"Hi"], "sampling_parameters": [b"[]"]}, "must be a JSON object"),
        ({"text_input": [b"Hi"], "sampling_parameters": [b'{"lora_name": "x"}']},
         "unsupported sampling parameter 'lora_name'"),
        ({"text_input": [b"Hi"], "sampling_parameters": [b'{"top_k": "many"}']},
         "'top_k': Expected `int"),
        ({"text_input": [b"Hi"], "sampling_parameters": [b'{"temperature": 9}']},
         "'temperature': Expected `float` <= 2.0"),
    ],
)  # fmt: skip
def test_bad_requests_are_invalid_arguments_naming_what_is_wrong(inputs, message):
    assert re.search(message, error_of(request(**inputs)).message)


def test_a_tensor_of_the_wrong_type_or_shape_is_refused():
    wrong_type = request(text_input=[b"Hi"])
    wrong_type.inputs.append(Tensor(name="stream", datatype="INT32", shape=[1]))
    wrong_type.raw_input_contents.append(struct.pack("<i", 1))
    assert "input 'stream' must be BOOL, got INT32" in error_of(wrong_type).message

    wrong_shape = request(text_input=[b"Hi"])
    wrong_shape.inputs[0].shape[:] = [2]
    assert "has shape [2] but 1 elements" in error_of(wrong_shape).message

    truncated = request(text_input=[b"Hi"])
    truncated.raw_input_contents[0] = truncated.raw_input_contents[0][:-1]
    assert "truncated" in error_of(truncated).message

    half_raw = request(text_input=[b"Hi"], stream=[True])
    del half_raw.raw_input_contents[1]
    assert "raw_input_contents" in error_of(half_raw).message


def test_outputs_asked_for_by_name_and_unknown_ones_refused():
    message = request(text_input=[b"Hi"])
    message.outputs.add(name="finish_reason")
    message.outputs.add(name="text_output")
    assert inference.generation(message).outputs == ["finish_reason", "text_output"]
    message.outputs.add(name="logits")
    assert "unexpected inference output 'logits'" in error_of(message).message


def test_an_answer_is_laid_out_as_tritonclient_reads_it():
    answer = inference.Answer(2)
    answer.texts = ["Q: ", "Q: "]
    for index, text, ids, reason in ((0, "ab", [1, 2], 0), (1, "c", [3], 1), (0, "d", [4], 2)):
        answer.add(inference_pb2.CompleteResponse(
            index=index, text=text, token_ids=ids, finish_reason=reason,
            usage=common_pb2.Usage(prompt_tokens=7),
        ))  # fmt: skip
    outputs = ["text_output", "finish_reason", "num_input_tokens", "num_output_tokens"]
    tensors, raw = answer.tensors(outputs)
    assert [(t.name, t.datatype, list(t.shape)) for t in tensors] == [
        ("text_output", "BYTES", [2]),
        ("finish_reason", "BYTES", [2]),
        ("num_input_tokens", "UINT32", [1]),
        ("num_output_tokens", "UINT32", [2]),
    ]
    assert raw[0] == _raw_bytes(b"Q: abd", b"Q: c")
    assert raw[1] == _raw_bytes(b"length", b"stop")
    assert struct.unpack("<I", raw[2]) == (7,)
    assert struct.unpack("<2I", raw[3]) == (3, 1)


class Processor:
    """Answers each Complete with `pieces`, one message each, after `delay` seconds or
    sooner once `release` is set; lists model "m"."""

    def __init__(self, pieces: tuple[str, ...] = ("a", "b", "c"), delay: float = 0):
        self.pieces, self.delay = pieces, delay
        self.release = threading.Event()
        self.requests: list[inference_pb2.CompleteRequest] = []
        self.cancelled: list[str] = []
        self.service = Service(
            inference_pb2.DESCRIPTOR.services_by_name["InferenceService"], inference_pb2_grpc
        )
        self.service.stream("Complete", self.complete)
        self.service.stream("Chat", self.complete)
        self.service.unary("ListModels", self.list_models)

    async def complete(self, request):
        self.requests.append(request)
        try:
            await until(self.release.is_set, self.delay)
        except asyncio.CancelledError:
            self.cancelled.append(request.text)
            raise
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield inference_pb2.CompleteResponse(
                text=piece, token_ids=[i], model="m",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                usage=common_pb2.Usage(prompt_tokens=5, completion_tokens=i + 1),
            )  # fmt: skip

    async def list_models(self, request):
        return inference_pb2.ListModelsResponse(models=[inference_pb2.Model(id="m")])


@contextlib.contextmanager
def kserve_door(processor: Processor, **gateway) -> Iterator[tuple[TestClient, Stub]]:
    """The gateway (REST, and KServe on its own port) in front of `processor`."""
    with serving(processor.service.add_to_server, ["prism.v1.InferenceService"]) as address:
        port = free_port()
        app = create_app(Router(StaticRegistry({"processor": [address]})),
                         kserve_address=f"127.0.0.1:{port}", **gateway)  # fmt: skip
        with TestClient(app) as rest, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield rest, pb_grpc.GRPCInferenceServiceStub(channel)


def _text(response: pb.ModelInferResponse) -> list[str]:
    index = [o.name for o in response.outputs].index("text_output")
    return [e.decode() for e in tensors._unpack_bytes(response.raw_output_contents[index], "")]


KEY = (("authorization", "Bearer s3cret"),)


def test_the_kserve_door_answers_under_the_api_key_with_restful_counts():
    processor = Processor()
    with kserve_door(processor, api_key="s3cret") as (rest, stub):
        assert stub.ServerLive(pb.ServerLiveRequest()).live
        assert stub.ServerReady(pb.ServerReadyRequest()).ready
        assert stub.ModelReady(pb.ModelReadyRequest(name="m")).ready
        assert not stub.ModelReady(pb.ModelReadyRequest(name="other")).ready
        infer = request(text_input=[b"Q: "], return_num_output_tokens=[True])
        for call in (lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="m")),
                     lambda: stub.ModelInfer(infer),
                     lambda: list(stub.ModelStreamInfer(iter([infer])))):  # fmt: skip
            with pytest.raises(grpc.RpcError) as denied:
                call()
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as unknown:
            stub.ModelConfig(pb.ModelConfigRequest(name="other"), metadata=KEY)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert stub.ModelConfig(pb.ModelConfigRequest(name="m"), metadata=KEY).config.name == "m"

        before = REQUESTS.labels("ModelInfer", "OK")._value.get()
        answer, call = stub.ModelInfer.with_call(infer, metadata=(*KEY, ("x-request-id", "k1")))
        assert ("x-request-id", "k1") in call.initial_metadata()
        assert _text(answer) == ["Q: abc"] and answer.id == "r1"
        assert [o.name for o in answer.outputs] == ["text_output", "num_output_tokens"]
        assert REQUESTS.labels("ModelInfer", "OK")._value.get() == before + 1
        (sent,) = processor.requests
        assert (sent.model, sent.text, sent.echo) == ("tiny", "Q: ", False)
        assert rest.get("/metrics").status_code == 200


def test_a_stream_answers_each_request_as_it_goes_and_survives_a_bad_one():
    with kserve_door(Processor()) as (_, stub):
        requests = [
            request(text_input=[b"one"], stream=[True]),
            request(text_input=[b"two"], stream=[True], sampling_parameters=[b'{"n": "x"}']),
        ]
        requests[0].id, requests[1].id = "good", "bad"
        replies = list(stub.ModelStreamInfer(iter(requests)))
        with pytest.raises(grpc.RpcError) as unary_stream:
            stub.ModelInfer(request(text_input=[b"one"], stream=[True]))
        assert unary_stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    errors = [r for r in replies if r.error_message]
    assert len(errors) == 1 and "'n': Expected `int" in errors[0].error_message
    assert errors[0].infer_response.id == "bad"
    good = [r.infer_response for r in replies if not r.error_message]
    assert [_text(r) for r in good] == [["a"], ["b"], ["c"]]
    assert [r.parameters["triton_final_response"].bool_param for r in good] == [
        False, False, True
    ]  # fmt: skip


def test_rest_and_kserve_share_one_bound_on_generations():
    processor = Processor(delay=30)
    with kserve_door(processor, max_in_flight=1) as (rest, stub):
        with futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(rest.post, "/v1/completions", json={"model": "m", "prompt": "hi"})
            # The processor has it, so it holds the one slot until released.
            assert wait_for(lambda: len(processor.requests) == 1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelInfer(request(text_input=[b"hi"]))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            processor.release.set()
            assert first.result().status_code == 200
        assert _text(stub.ModelInfer(request(text_input=[b"hi"]))) == ["hiabc"]


def test_a_client_that_goes_away_cancels_its_requests_on_the_processor():
    processor = Processor(delay=30)
    with kserve_door(processor) as (_, stub):
        unary = stub.ModelInfer.future(request(text_input=[b"unary"]))
        streamed = stub.ModelStreamInfer(iter([request(text_input=[b"streamed"], stream=[True])]))
        assert wait_for(lambda: len(processor.requests) == 2)
        unary.cancel()
        streamed.cancel()
        assert wait_for(lambda: sorted(processor.cancelled) == ["streamed", "unary"])
