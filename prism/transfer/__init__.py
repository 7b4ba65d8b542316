"""Tensors from the process that makes them (the owner: the encoder) to the one that uses
them (the reader: a worker), behind one interface with one implementation per way.

- `nixl` (prism.transfer.nixl): the tensor stays in the owner's memory (host, or the GPU's
  where there is one), registered with NIXL; the descriptor says where, and the reader
  pulls the bytes (UCX: shared memory or CMA on one host, TCP or RDMA across hosts, CUDA
  IPC or GPUDirect between GPUs). The owner frees it on the reader's
  notification or when its lease ends.
- `inline` (prism.transfer.inline): the bytes travel inside the descriptor, in the gRPC
  message. No NIXL, no lease, one copy more: for machines where NIXL cannot run.

A reader of either kind reads inline descriptors; NIXL descriptors need a NIXL reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prism.config.common import TRANSFERS

if TYPE_CHECKING:  # torch is imported where tensors are handled, not by the CLI
    import torch

    from prism.proto.stage.v1 import tensor_pb2


class TransferError(Exception):
    """A tensor could not be published or fetched; the message says why."""


@dataclass
class TransferStats:
    """Counters of one transfer.

    `bytes_moved`, `transfers` and `transfer_seconds_total` count reads it made as a reader;
    `published`, `released` (freed on the reader's notification) and `reclaimed` (freed
    when the lease expired unread) count its publications as an owner.
    """

    bytes_moved: int = 0
    transfers: int = 0
    transfer_seconds_total: float = 0.0
    pool_bytes_in_use: int = 0
    published: int = 0
    released: int = 0
    reclaimed: int = 0


class Transfer(Protocol):
    """What the encoder and the workers use, whichever way the bytes travel."""

    name: str

    def publish(
        self, tensor: torch.Tensor, tag: str, lease_s: float | None = None
    ) -> tensor_pb2.TensorDescriptor:
        """Describes `tensor` for exactly one reader; `tag` is unique among the owner's
        publications still held."""
        ...

    def fetch(
        self, descriptor: tensor_pb2.TensorDescriptor, timeout_s: float = 10.0
    ) -> torch.Tensor:
        """The described tensor, as a new tensor of this process (blocking)."""
        ...

    def poll(self) -> int:
        """Frees what readers have read and what nobody read in time; how many."""
        ...

    def close(self) -> None: ...

    @property
    def pool_bytes_in_use(self) -> int: ...

    @property
    def stats(self) -> TransferStats: ...


def open_transfer(
    kind: str, pool_bytes: int, lease_s: float = 30.0, device: torch.device | str = "cpu"
) -> Transfer:
    """The transfer `--transfer` names, its NIXL pool on `device` (host memory for "cpu").
    NIXL is imported only when asked for."""
    if kind == "inline":
        from prism.transfer.inline import InlineTransfer

        return InlineTransfer()
    if kind == "nixl":
        from prism.transfer.nixl import NixlTransfer

        return NixlTransfer(pool_bytes=pool_bytes, lease_s=lease_s, device=device)
    raise ValueError(f"unknown transfer {kind!r}; choose from {', '.join(TRANSFERS)}")
