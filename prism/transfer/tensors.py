"""Tensors as descriptors carry them: dtype names, and the bytes of an inline tensor."""

from __future__ import annotations

import threading
import time

import torch

from prism.proto.stage.v1 import tensor_pb2
from prism.transfer import TransferError, TransferStats

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(tensor: torch.Tensor) -> str:
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise TransferError(f"cannot transfer {tensor.dtype}; supported: {sorted(DTYPES)}")
    return name


def from_inline(descriptor: tensor_pb2.TensorDescriptor) -> torch.Tensor:
    """The tensor an inline descriptor carries, checked against its dtype and shape."""
    dtype = DTYPES.get(descriptor.dtype)
    if dtype is None:
        raise TransferError(f"inline tensor: unknown dtype {descriptor.dtype!r}")
    shape = list(descriptor.shape)
    data = descriptor.inline_data
    expected = dtype.itemsize
    for size in shape:
        expected *= size
    if len(data) != expected or not data:
        raise TransferError(
            f"inline tensor: shape {shape} of {descriptor.dtype} is {expected} bytes, "
            f"but {len(data)} came"
        )
    # bytes are read-only: the copy makes a tensor of this process's own.
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape)


def fetch_inline(
    descriptor: tensor_pb2.TensorDescriptor, stats: TransferStats, lock: threading.Lock
) -> torch.Tensor:
    """`from_inline`, counted in a reader's `stats` (guarded by `lock`)."""
    started = time.perf_counter()
    tensor = from_inline(descriptor)
    with lock:
        stats.bytes_moved += len(descriptor.inline_data)
        stats.transfers += 1
        stats.transfer_seconds_total += time.perf_counter() - started
    return tensor
