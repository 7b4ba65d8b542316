"""The inline transfer: a tensor's bytes travel in its descriptor, inside the gRPC message
that carries it. Nothing is held by the owner, so there is nothing to free or lease."""

from __future__ import annotations

import threading
import uuid
from dataclasses import replace

import torch

from prism.proto.stage.v1 import tensor_pb2
from prism.transfer import TransferError, TransferStats
from prism.transfer.tensors import dtype_name, fetch_inline


class InlineTransfer:
    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"prism-inline-{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._stats = TransferStats()

    @property
    def pool_bytes_in_use(self) -> int:
        return 0

    @property
    def stats(self) -> TransferStats:
        with self._lock:
            return replace(self._stats)

    def publish(
        self, tensor: torch.Tensor, tag: str, lease_s: float | None = None
    ) -> tensor_pb2.TensorDescriptor:
        name = dtype_name(tensor)
        if tensor.numel() == 0:
            raise TransferError(f"cannot publish an empty tensor (tag {tag!r})")
        # A byte view of the tensor's own memory, whatever its dtype (bfloat16 included).
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        with self._lock:
            self._stats.published += 1
            self._stats.released += 1
        return tensor_pb2.TensorDescriptor(dtype=name, shape=list(tensor.shape), inline_data=data)

    def fetch(
        self, descriptor: tensor_pb2.TensorDescriptor, timeout_s: float = 10.0
    ) -> torch.Tensor:
        if descriptor.WhichOneof("location") != "inline_data":
            raise TransferError(
                "this process reads inline tensors only (--transfer inline), "
                f"not {descriptor.WhichOneof('location') or 'an empty descriptor'}"
            )
        return fetch_inline(descriptor, self._stats, self._lock)

    def poll(self) -> int:
        return 0

    def close(self) -> None:
        pass
