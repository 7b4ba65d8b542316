"""The NIXL agent of a `NixlTransfer`, apart from its pool bookkeeping: every NIXL call goes
through one lock here, NIXL's errors come out as `TransferError` with a hint at what their
terse names usually mean, and a READ waits here for its completion holding no lock.

It also knows which owners' metadata it has loaded: an owner that failed a read is
forgotten, so that its next descriptor reconnects from scratch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from prism.proto.stage.v1 import tensor_pb2
from prism.transfer import TransferError
from prism.transfer.nixl_compat import nixl_agent

log = logging.getLogger(__name__)

T = TypeVar("T")

# What NIXL's terse error names usually mean for a Prism read.
_NIXL_HINTS = {
    "nixlRemoteDisconnectError": "the owner's process is gone",
    "nixlBackendError": "UCX failed; is the owner's process gone?",
    "nixlNotFoundError": "memory or agent unknown to NIXL; stale descriptor?",
    "nixlMismatchError": "agent metadata is not valid",
}

# (address, length, device id) of one memory region.
Region = tuple[int, int, int]


class StuckTransfer(TransferError):
    """A failed read whose NIXL handle could not be released: its buffer may still be written."""


def read_device_memory_by_ipc() -> None:
    """Lets UCX READ device memory over CUDA IPC, in this process and those it starts (a
    value set in the environment wins). UCX turns CUDA IPC's zero-copy GET off where NVML
    finds no NVLink (a PCIe card, a single GPU), and a READ of device memory then goes as
    active messages over TCP, staged through the host (bench/notes/gpu-leases.md, the second lease);
    NIXL turns it on itself in releases after ai-dynamo/nixl#2208."""
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")


def _new_nixl_agent(name: str) -> Any:
    try:
        import nixl
    except ImportError as exc:
        raise TransferError(
            f"NIXL is not installed ({exc}); install prism-mesh[cpu] or prism-mesh[gpu]"
        ) from exc
    try:
        return nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
    except Exception as exc:
        raise TransferError(f"cannot start NIXL agent {name!r} with UCX: {exc!r}") from exc


class NixlAgent:
    """One NIXL agent (UCX) with one registered pool, and the owners it reads from."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._agent: Any = _new_nixl_agent(name)
        self._lock = threading.Lock()
        self._registration: Any = None
        self._remotes: dict[str, bytes] = {}

    def register(self, pool: torch.Tensor) -> bytes:
        """Registers `pool`; the agent's metadata, taken after, so that every peer sees the
        whole pool."""
        try:
            self._registration = self._agent.register_memory(pool)
            return self._agent.get_agent_metadata()
        except Exception as exc:
            raise TransferError(f"cannot register the transfer pool: {exc!r}") from exc

    def call(self, doing: str, call: Callable[[Any], T]) -> T:
        with self._lock:
            if self._agent is None:
                raise TransferError(f"transfer agent {self.name} is closed")
            try:
                return call(self._agent)
            except TransferError:
                raise
            except Exception as exc:
                kind = type(exc).__name__
                hint = _NIXL_HINTS.get(kind, kind)
                raise TransferError(f"{doing}: {exc} ({hint})") from exc

    def notifications(self) -> dict[str, list[bytes]]:
        """The readers' notifications since the last call, by agent name."""
        return self.call("collecting notifications", lambda a: a.get_new_notifs())

    def connect(self, name: str, metadata: bytes) -> None:
        """Loads the metadata of the owner `name` (once per name and metadata)."""
        if name == self.name:
            return

        def load(agent: Any) -> None:
            known = self._remotes.get(name)
            if known == metadata:
                return
            if known is not None:
                agent.remove_remote_agent(name)
                del self._remotes[name]
            loaded = agent.add_remote_agent(metadata)
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            self._remotes[loaded] = metadata
            if loaded != name:
                raise TransferError(
                    f"descriptor names agent {name!r} but its metadata is {loaded!r}"
                )

        self.call(f"connecting to agent {name!r}", load)

    def forget(self, name: str) -> None:
        """Drops a failed owner so that its next descriptor reconnects from scratch."""
        with self._lock:
            if self._agent is None or self._remotes.pop(name, None) is None:
                return
            try:
                self._agent.remove_remote_agent(name)
            except Exception:
                log.debug("removing remote agent %s failed", name, exc_info=True)

    def read(
        self,
        local: list[Region],
        local_memory: str,
        location: tensor_pb2.NixlLocation,
        regions: list[Region],
        memory: str,
        deadline: float,
        timeout_s: float,
    ) -> float:
        """READs the owner's `regions` (in its `memory`) into `local` (in `local_memory`);
        returns the seconds the read took. Raises StuckTransfer when a failed read's handle
        could not be released."""
        name, tag = location.agent_name, location.notification_tag
        self.connect(name, location.agent_metadata)
        doing = f"reading {tag!r} from agent {name!r}"
        started = time.perf_counter()
        handle = self.call(
            doing,
            lambda a: a.initialize_xfer(
                "READ",
                a.get_xfer_descs(local, local_memory),
                a.get_xfer_descs(regions, memory),
                name,
                tag.encode(),
            ),
        )
        outcome = "failed"
        try:
            state = self.call(doing, lambda a: a.transfer(handle))
            pause = 0.0
            while state == "PROC":
                if time.monotonic() >= deadline:
                    outcome = "timed out"
                    raise TransferError(f"{doing}: no completion within {timeout_s} s")
                time.sleep(pause)
                pause = min(max(2 * pause, 50e-6), 1e-3)
                state = self.call(doing, lambda a: a.check_xfer_state(handle))
            if state != "DONE":
                raise TransferError(f"{doing}: NIXL reported {state} (owner gone?)")
            outcome = "done"
        finally:
            if outcome == "failed":
                self.forget(name)
            try:
                self.call(doing, lambda a: a.release_xfer_handle(handle))
            except TransferError as exc:
                if outcome != "done":
                    raise StuckTransfer(str(exc)) from exc
                log.warning("releasing a finished NIXL read failed: %s", exc)
        return time.perf_counter() - started

    def close(self) -> None:
        """Deregisters the pool, then destroys the agent."""
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is not None:
                try:
                    agent.deregister_memory(self._registration)
                except Exception:
                    log.warning("deregistering the pool of %s failed", self.name, exc_info=True)
                self._remotes.clear()
            # Gone, with its progress thread, before the memory it registered is freed.
            del agent
