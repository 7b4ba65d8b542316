"""The tensors of Triton's vLLM backend, and KServe's layout of them: what a request's
inputs may be, and how they are read."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from prism.proto.kserve import grpc_service_pb2 as kserve
from prism.rpc.errors import invalid


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
CONFIG_TYPES = {"BYTES": kserve.TYPE_STRING, "BOOL": kserve.TYPE_BOOL,
                 "UINT32": kserve.TYPE_UINT32}  # fmt: skip


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


def pack_bytes(elements: Iterable[bytes]) -> bytes:
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
