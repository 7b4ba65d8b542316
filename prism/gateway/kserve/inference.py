"""A KServe inference request as a completion (`Generation`), and what the completion's
messages add up to as output tensors (`Answer`)."""

from __future__ import annotations

import base64
import binascii
import json
import struct
from dataclasses import dataclass, field
from typing import Any

from prism.gateway import bodies
from prism.gateway.kserve.tensors import OUTPUTS, pack_bytes, read_inputs
from prism.gateway.openai import protocol, schemas
from prism.gateway.openai.completions import completion_request
from prism.proto.kserve import grpc_service_pb2 as kserve
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import invalid

# The sampling parameters a request may set: chat's and completions' own, less what an
# input tensor says (`stream`) and OpenAI's bookkeeping.
_SAMPLING = set(schemas.Sampling.__struct_fields__) - {
    "stream", "stream_options", "user", "metadata", "store", "service_tier"
}  # fmt: skip


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise invalid(f"input '{name}' is not UTF-8 text", name) from None


def _sampling_body(text: str) -> dict[str, Any]:
    """`sampling_parameters` as the fields of a completion request."""
    try:
        params = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        message = f"sampling_parameters is not valid JSON: {exc}"
        raise invalid(message, "sampling_parameters") from None
    if not isinstance(params, dict):
        raise invalid("sampling_parameters must be a JSON object", "sampling_parameters")
    for key, value in params.items():
        if key not in _SAMPLING:
            raise invalid(f"unsupported sampling parameter '{key}'", key)
        if isinstance(value, str) and key == "structured_outputs":
            params[key] = protocol.json_text(value, key)
    return params


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
    # Triton's clients send numbers and booleans as strings, too.
    message = completion_request(bodies.typed(body, schemas.CompletionRequest, strict=False))
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
        self.reasons[message.index] = protocol.finish_reason(message.finish_reason)

    def tensors(self, outputs: list[str]) -> tuple[list, list[bytes]]:
        """The output tensors and their raw contents, in the order asked."""
        data: dict[str, tuple[list[int], bytes]] = {
            "text_output": ([self.choices], pack_bytes(t.encode() for t in self.texts)),
            "finish_reason": ([self.choices], pack_bytes(str(r).encode() for r in self.reasons)),
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
