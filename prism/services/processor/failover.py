"""Failover: a stage call that finds its replica full or gone before its first reply
goes to another replica; a request whose worker dies mid-stream migrates, continuing
elsewhere from the prompt plus the tokens already streamed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from prism import telemetry
from prism.modes import MeshRole
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2, errors_pb2
from prism.rpc import multiplex
from prism.rpc.channel import connected
from prism.rpc.errors import PrismError
from prism.runtime.clients import Peers

log = logging.getLogger(__name__)

CallT = TypeVar("CallT", bound=grpc.aio.Call | multiplex.MultiplexCall)

# A worker could not read what another replica held for the request (prefill's KV, an
# encoder's embeddings): that replica is lost, not the worker, and so is its data for every
# worker. The request runs again from the stage that lost it.
_UPSTREAM_LOST = (
    errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
    errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE,
)


@dataclass
class StageCalls:
    """One request's stage calls: the one it waits on, so that an Abort can cancel it,
    and the replicas holding what a later stage reads."""

    current: grpc.aio.Call | multiplex.MultiplexCall | None = None
    # The replica `current` went to.
    address: str = ""
    aborted: bool = False
    # Per reason a reader reports a lost read with: the replica that holds the data.
    holders: dict[errors_pb2.ErrorReason, str] = field(default_factory=dict)

    def track(self, call: CallT, address: str = "") -> CallT:
        self.current = call
        self.address = address
        if self.aborted:
            call.cancel()
        return call

    def abort(self) -> None:
        self.aborted = True
        if self.current is not None:
            self.current.cancel()


def _replica_gone(exc: grpc.aio.AioRpcError) -> bool:
    """The replica is down or draining (not the one whose data it could not read)."""
    return (
        exc.code() == grpc.StatusCode.UNAVAILABLE
        and PrismError.from_rpc_error(exc).reason not in _UPSTREAM_LOST
    )


def _replica_full(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# One attempt at a request: (engine request id, prompt, sampling) to its replies.
Attempt = Callable[
    [str, list[int], common_pb2.SamplingParams],
    Awaitable[AsyncIterator[engine_pb2.GenerateResponse]],
]


class Failover:
    def __init__(self, peers: Peers) -> None:
        self.peers = peers
        self.router = peers.router

    async def on_replica(
        self,
        role: MeshRole,
        call: StageCalls,
        start: Callable[[str], grpc.aio.Call | multiplex.MultiplexCall],
        retry_gone: bool = True,
        keys: Sequence[int] = (),
        blocks: int = 0,
        content: str = "",
        adapter: str = "",
    ) -> AsyncIterator:
        """The replies of the call `start(address)` makes to a replica of `role` (one for a
        unary call), for a prompt of `blocks` blocks whose `keys` kv routing knows, or for
        media whose `content` hash it knows, run with LoRA `adapter` if named. If the
        replica turns out to be full, or gone (with `retry_gone`), before its first reply,
        tries once more on another one; one whose channel does not connect is passed over
        for another before any call."""
        tried: list[str] = []
        while True:
            address = self.router.pick(
                role, exclude=tried, keys=keys, content=content, adapter=adapter
            )
            if await self._passed_over(role, address, tried):
                continue
            replied = False
            first_reply = telemetry.STAGE_FIRST_REPLY.labels(role)
            open_for = telemetry.STAGE_CALL_SECONDS.labels(role)
            # Counted as waiting until its first reply, or its end without one.
            waiting = telemetry.STAGE_CALLS_WAITING.labels(role)
            started = time.perf_counter()
            waiting.inc()
            try:
                with self.router.using(address, blocks, keys) as computed:
                    stage_call = call.track(start(address), address)
                    try:
                        if isinstance(stage_call, grpc.aio.UnaryUnaryCall):
                            reply = await stage_call
                            replied = True
                            first_reply.observe(time.perf_counter() - started)
                            waiting.dec()
                            yield reply
                        else:
                            async for reply in stage_call:
                                if not replied:
                                    replied = True
                                    first_reply.observe(time.perf_counter() - started)
                                    waiting.dec()
                                computed()
                                yield reply
                    finally:
                        # A request that ends early (stop string, abort, error elsewhere)
                        # leaves the call open: end it here, not whenever it is collected.
                        stage_call.cancel()
                        open_for.inc(time.perf_counter() - started)
                return
            except grpc.aio.AioRpcError as exc:
                # Another replica may do what this one could not, if nothing was sent yet.
                gone = _replica_gone(exc)
                if gone:
                    self.router.mark_down(address)
                if (
                    replied
                    or tried
                    or call.aborted
                    or not ((gone and retry_gone) or _replica_full(exc))
                ):
                    raise
                tried.append(address)
                if not [a for a in self.router.registry.endpoints(role) if a not in tried]:
                    raise
                log.warning(
                    "%s %s unavailable (%s); trying another replica", role, address, exc.details()
                )
            finally:
                if not replied:
                    waiting.dec()

    async def _passed_over(self, role: MeshRole, address: str, tried: list[str]) -> bool:
        """Whether the replica at `address` is passed over (then added to `tried`): its
        channel does not connect in a moment (one that came up, or back, moments ago is
        given that), and another replica is left."""
        if await connected(self.peers.channel(address)):
            return False
        if not [a for a in self.router.registry.endpoints(role) if a not in (*tried, address)]:
            return False
        # Gone, and nothing was sent to it: safe to take elsewhere, even a decode (which
        # may not retry once it could have read the KV).
        self.router.mark_down(address)
        tried.append(address)
        log.warning("%s %s does not connect; trying another replica", role, address)
        return True

    async def migrating(
        self,
        attempt: Attempt,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        call: StageCalls,
        limit: int,
    ) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The replies of `attempt`, made again up to `limit` times if the worker streaming
        it dies, or the replica holding what it reads is lost: the new attempt continues
        from the prompt plus the tokens already streamed."""
        emitted: list[int] = []
        for number in range(limit + 1):
            if sampling.HasField("max_tokens") and len(emitted) >= sampling.max_tokens:
                # The worker died between its last token and its last reply.
                finish = engine_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH)
                yield engine_pb2.GenerateResponse(last=finish)
                return
            resumed = common_pb2.SamplingParams()
            resumed.CopyFrom(sampling)
            if sampling.HasField("max_tokens"):
                resumed.max_tokens = sampling.max_tokens - len(emitted)
            resumed.min_tokens = max(0, sampling.min_tokens - len(emitted))
            # A new engine request id: the old one may linger in a prefill's connector.
            engine_id = f"{request_id}-migrated-{number}" if number else request_id
            call.holders.clear()
            try:
                replies = await attempt(engine_id, prompt_ids + emitted, resumed)
                # Closed here, when the request ends for any reason: its stage calls end
                # and what it holds is freed now, not when the garbage is collected.
                async with contextlib.aclosing(replies):
                    async for reply in replies:
                        if number:
                            # Usage counts the client's prompt, not the one resumed from:
                            # the stream's first message was the first attempt's.
                            reply.ClearField("first")
                        emitted += reply.token_ids
                        yield reply
                return
            except grpc.aio.AioRpcError as exc:
                reason = PrismError.from_rpc_error(exc).reason
                upstream_lost = reason in _UPSTREAM_LOST
                if upstream_lost and reason in call.holders:
                    # Run again, the request goes elsewhere than the replica that lost it.
                    self.router.mark_down(call.holders[reason])
                # A replica lost before the first token was tried again already
                # (on_replica), unless the data a worker was to read went with it.
                lost = (emitted and _replica_gone(exc)) or upstream_lost
                if number == limit or call.aborted or not lost:
                    raise
                log.warning(
                    "request %s lost a replica after %d tokens (%s); resuming elsewhere",
                    request_id, len(emitted), exc.details(),
                )  # fmt: skip
