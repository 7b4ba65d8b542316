"""The NIXL transfer: the owner publishes, the reader pulls.

The owner copies a tensor into a slice of one memory pool that its NIXL agent registered at
start-up, and hands out a `TensorDescriptor`: its agent name and metadata, the slice's
address and length, dtype, shape, a notification tag and a lease. The reader loads the
owner's metadata (once per owner), READs the bytes into a slice of its own registered pool,
sending the tag as the notification, and copies them out into a fresh tensor.

A pool lives in host memory (NIXL's DRAM) or, given a CUDA device, in that device's memory
(VRAM, with the device's id in every region): an encoder on a GPU publishes straight from
device memory, and a worker on a GPU reads into device memory, so that embeddings go GPU to
GPU (UCX: CUDA IPC on one host, GPUDirect RDMA across hosts) and never through the host. The
notification tells the owner it may free the slice (`poll`); a lease frees it if nobody
reads. One descriptor is meant for exactly one read.

Only raw (address, length, device) triples travel: NIXL's own descriptor serialization is
pickle and is never applied to bytes from the network.

This module keeps the pools' bookkeeping (slices, publications, leases); the NIXL agent
itself, every call to it and the wait for a read, is prism.transfer.nixl_agent's.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, replace

import torch

from prism.proto.stage.v1 import tensor_pb2
from prism.transfer import TransferError, TransferStats
from prism.transfer.nixl_agent import NixlAgent, Region, StuckTransfer, read_device_memory_by_ipc
from prism.transfer.tensors import DTYPES, dtype_name, fetch_inline

log = logging.getLogger(__name__)

ALIGNMENT = 64
DEFAULT_POOL_BYTES = 256 * 2**20


class PoolAllocator:
    """First-fit allocator of aligned blocks in [0, size); freeing merges adjacent free blocks.

    Offsets only, no memory. Not thread-safe: TransferAgent guards it with its lock.
    """

    def __init__(self, size: int, alignment: int = ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if size < alignment:
            raise ValueError(f"pool of {size} bytes is smaller than one {alignment}-byte block")
        self.alignment = alignment
        self.size = size - size % alignment
        self.bytes_in_use = 0
        # Sorted (offset, length) runs; never adjacent, since free() merges neighbours.
        self._free: list[tuple[int, int]] = [(0, self.size)]
        self._used: dict[int, int] = {}

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a new block of at least `nbytes`, or None when no run is big enough."""
        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes")
        length = -(-nbytes // self.alignment) * self.alignment
        for i, (offset, free) in enumerate(self._free):
            if free >= length:
                if free == length:
                    del self._free[i]
                else:
                    self._free[i] = (offset + length, free - length)
                self._used[offset] = length
                self.bytes_in_use += length
                return offset
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset, None)
        if length is None:
            raise ValueError(f"offset {offset} is not allocated")
        self.bytes_in_use -= length
        i = bisect.bisect_left(self._free, (offset, 0))
        if i < len(self._free) and self._free[i][0] == offset + length:
            length += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == offset:
            start, before = self._free[i - 1]
            self._free[i - 1] = (start, before + length)
        else:
            self._free.insert(i, (offset, length))


@dataclass
class _Publication:
    offset: int
    id: int


# NIXL's names of the memory types a descriptor may carry.
_MEMORY_TYPES = {tensor_pb2.MEMORY_TYPE_DRAM: "DRAM", tensor_pb2.MEMORY_TYPE_VRAM: "VRAM"}


def _parse(
    descriptor: tensor_pb2.TensorDescriptor,
) -> tuple[torch.dtype, list[int], list[Region], str]:
    """Checks a NIXL descriptor from the wire before any memory is touched."""
    location = descriptor.nixl
    what = f"descriptor {location.notification_tag!r} from agent {location.agent_name!r}"
    if not location.agent_name or not location.agent_metadata:
        raise TransferError(f"{what}: agent name and metadata are required")
    if not location.notification_tag:
        raise TransferError(f"{what}: a notification tag is required")
    memory = _MEMORY_TYPES.get(location.memory_type)
    if memory is None:
        raise TransferError(f"{what}: memory type {location.memory_type} is not DRAM or VRAM")
    dtype = DTYPES.get(descriptor.dtype)
    if dtype is None:
        raise TransferError(f"{what}: unknown dtype {descriptor.dtype!r}")
    regions = [(r.address, r.length, r.device_id) for r in location.regions]
    if not regions or any(address == 0 or length == 0 for address, length, _ in regions):
        raise TransferError(f"{what}: needs one or more non-empty memory regions")
    shape = list(descriptor.shape)
    expected = math.prod(shape) * dtype.itemsize
    total = sum(length for _, length, _ in regions)
    if expected != total:
        raise TransferError(
            f"{what}: shape {shape} of {descriptor.dtype} is {expected} bytes "
            f"but its regions hold {total}"
        )
    expiry = location.lease_expiry_unix_ms
    if expiry and expiry <= time.time() * 1000:
        raise TransferError(f"{what}: its lease expired at {expiry} ms; the owner freed it")
    return dtype, shape, regions, memory


class NixlTransfer:
    """One NIXL agent (UCX) and one registered pool per process; owner and reader at once.

    Thread-safe: `publish`, `fetch` and `poll` may run in different threads at the same
    time. Pool bookkeeping has one lock and NIXL calls another, each held for one step only:
    `publish` makes no NIXL call, and a read's wait for completion holds no lock (posting
    it does: on one host UCX copies with CMA inside that call).
    """

    def __init__(
        self,
        name: str | None = None,
        pool_bytes: int = DEFAULT_POOL_BYTES,
        lease_s: float = 30.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.name = name or f"prism-{uuid.uuid4().hex}"
        self.lease_s = lease_s
        self._allocator = PoolAllocator(pool_bytes)
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise TransferError(f"a NIXL pool lives in host or CUDA memory, not on {device}")
        # torch's allocators align it to 64 bytes or more. close() drops it: a tensor freed
        # by a non-main thread (say, with a gRPC servicer) during interpreter exit aborts
        # Python.
        self._pool: torch.Tensor | None = torch.empty(
            self._allocator.size, dtype=torch.uint8, device=device
        )
        self._pool_address = self._pool.data_ptr()
        self.device = self._pool.device
        self._memory = "VRAM" if self.device.type == "cuda" else "DRAM"
        self._device_id = self.device.index or 0
        if self._memory == "VRAM":
            read_device_memory_by_ipc()
        self._agent = NixlAgent(self.name)
        self._metadata = self._agent.register(self._pool)

        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)
        self._stats = TransferStats()
        self._published: dict[str, _Publication] = {}
        self._leases: list[tuple[float, int, str]] = []
        self._ids = itertools.count()

    def __enter__(self) -> NixlTransfer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def pool_bytes_in_use(self) -> int:
        with self._lock:
            return self._allocator.bytes_in_use

    @property
    def stats(self) -> TransferStats:
        with self._lock:
            return replace(self._stats, pool_bytes_in_use=self._allocator.bytes_in_use)

    def publish(
        self, tensor: torch.Tensor, tag: str, lease_s: float | None = None
    ) -> tensor_pb2.TensorDescriptor:
        """Copies `tensor` into the pool and describes it for one reader.

        `tag` must be unique among this agent's live publications (NIXL matches notifications
        by prefix, so build it from a request id and an item index).
        """
        name = dtype_name(tensor)
        if not tag:
            raise TransferError("a notification tag is required")
        lease_s = self.lease_s if lease_s is None else lease_s
        if lease_s <= 0:
            raise TransferError(f"lease_s must be positive, got {lease_s}")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise TransferError(f"cannot publish an empty tensor (tag {tag!r})")

        reserved = self._reserve(tag, nbytes)
        if reserved is None:
            self.poll()
            reserved = self._reserve(tag, nbytes)
        if reserved is None:
            with self._lock:
                free = self._allocator.size - self._allocator.bytes_in_use
                largest = self._allocator.largest_free
            raise TransferError(
                f"transfer pool full: {nbytes} bytes wanted for {tag!r}, {free} of "
                f"{self._allocator.size} free (largest run {largest}); readers are slow or gone"
            )
        publication, pool = reserved
        offset = publication.offset
        try:
            view = pool[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            if self._memory == "VRAM":
                # A peer may read as soon as it has the descriptor.
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:
            self._unpublish(tag)
            raise

        lease_end, wall_now = time.monotonic() + lease_s, time.time()
        with self._lock:
            if self._published.get(tag) is not publication:
                raise TransferError(f"{tag!r} was dropped while it was copied (agent closed?)")
            heapq.heappush(self._leases, (lease_end, publication.id, tag))
            self._stats.published += 1
        location = tensor_pb2.NixlLocation(
            agent_name=self.name,
            agent_metadata=self._metadata,
            memory_type=(
                tensor_pb2.MEMORY_TYPE_VRAM
                if self._memory == "VRAM"
                else tensor_pb2.MEMORY_TYPE_DRAM
            ),
            regions=[
                tensor_pb2.MemoryRegion(
                    address=self._pool_address + offset, length=nbytes, device_id=self._device_id
                )
            ],
            notification_tag=tag,
            lease_expiry_unix_ms=int((wall_now + lease_s) * 1000),
        )
        return tensor_pb2.TensorDescriptor(dtype=name, shape=list(tensor.shape), nixl=location)

    def poll(self) -> int:
        """Frees the slices whose reader has notified and those whose lease ran out.

        Cheap (NIXL hands over a queue its progress thread filled); the owner calls it
        regularly, and `publish` calls it when the pool is full. Returns how many it freed.
        """
        notifications = self._agent.notifications()
        now = time.monotonic()
        freed = 0
        with self._lock:
            for messages in notifications.values():
                for message in messages:
                    publication = self._published.pop(message.decode(errors="replace"), None)
                    if publication is not None:
                        self._allocator.free(publication.offset)
                        self._stats.released += 1
                        freed += 1
            while self._leases and self._leases[0][0] <= now:
                _, publication_id, tag = heapq.heappop(self._leases)
                publication = self._published.get(tag)
                if publication is not None and publication.id == publication_id:
                    del self._published[tag]
                    self._allocator.free(publication.offset)
                    self._stats.reclaimed += 1
                    freed += 1
            if freed:
                self._space.notify_all()
        return freed

    def fetch(
        self, descriptor: tensor_pb2.TensorDescriptor, timeout_s: float = 10.0
    ) -> torch.Tensor:
        """Reads the described tensor from its owner into a new tensor on this agent's pool
        device (blocking).

        Raises TransferError, within about `timeout_s`, when the descriptor is malformed or
        expired, the owner is gone, NIXL reports an error, or the read does not complete.
        """
        if descriptor.WhichOneof("location") == "inline_data":
            return fetch_inline(descriptor, self._stats, self._lock)
        deadline = time.monotonic() + timeout_s
        dtype, shape, regions, memory = _parse(descriptor)
        nbytes = sum(length for _, length, _ in regions)
        offset, pool = self._take_space(nbytes, deadline, descriptor.nixl.notification_tag)
        try:
            seconds = self._read_into(offset, descriptor, regions, memory, deadline, timeout_s)
            tensor = pool[offset : offset + nbytes].view(dtype).view(shape).clone()
        except StuckTransfer:
            log.error("leaking %d pool bytes at offset %d: NIXL kept a failed read", nbytes, offset)
            raise
        except BaseException:
            self._free(offset)
            raise
        with self._lock:
            self._allocator.free(offset)
            self._space.notify_all()
            self._stats.bytes_moved += nbytes
            self._stats.transfers += 1
            self._stats.transfer_seconds_total += seconds
        return tensor

    def close(self) -> None:
        """Destroys the NIXL agent after deregistering the pool, then drops every publication."""
        self._agent.close()
        with self._lock:
            for publication in self._published.values():
                self._allocator.free(publication.offset)
            self._published.clear()
            self._leases.clear()
            self._pool = None
            self._space.notify_all()

    def _reserve(self, tag: str, nbytes: int) -> tuple[_Publication, torch.Tensor] | None:
        with self._lock:
            if self._pool is None:
                raise TransferError(f"transfer agent {self.name} is closed")
            if tag in self._published:
                raise TransferError(f"tag {tag!r} is already published and not yet released")
            offset = self._allocator.alloc(nbytes)
            if offset is None:
                return None
            # Not in the lease heap until the copy is done: a lease starts at hand-out.
            publication = _Publication(offset, next(self._ids))
            self._published[tag] = publication
            return publication, self._pool

    def _unpublish(self, tag: str) -> None:
        with self._lock:
            publication = self._published.pop(tag, None)
            if publication is not None:
                self._allocator.free(publication.offset)
                self._space.notify_all()

    def _free(self, offset: int) -> None:
        with self._lock:
            self._allocator.free(offset)
            self._space.notify_all()

    def _take_space(self, nbytes: int, deadline: float, tag: str) -> tuple[int, torch.Tensor]:
        if nbytes > self._allocator.size:
            raise TransferError(
                f"{tag!r} is {nbytes} bytes, larger than the {self._allocator.size}-byte pool"
            )
        with self._space:
            while True:
                if self._pool is None:
                    raise TransferError(f"transfer agent {self.name} is closed")
                offset = self._allocator.alloc(nbytes)
                if offset is not None:
                    return offset, self._pool
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferError(
                        f"transfer pool full: no room for {nbytes} bytes of {tag!r} in time"
                    )
                self._space.wait(remaining)

    def _read_into(
        self,
        offset: int,
        descriptor: tensor_pb2.TensorDescriptor,
        regions: list[Region],
        memory: str,
        deadline: float,
        timeout_s: float,
    ) -> float:
        """READs the regions (in the owner's `memory`) into the pool at `offset`; returns the
        seconds the read took."""
        local, address = [], self._pool_address + offset
        for _, length, _ in regions:
            local.append((address, length, self._device_id))
            address += length
        return self._agent.read(
            local, self._memory, descriptor.nixl, regions, memory, deadline, timeout_s
        )
