"""Many streaming calls over one gRPC stream, for the hops that carry a token per call per
engine step.

A stage that streams tokens pays gRPC's cost per message twice, once to send and once to
receive, and a server-streaming call per request sends one message per request per step.
Over one bidirectional stream per peer, what every call has ready goes out as one
message: at concurrency 32, one message per step instead of 32. gRPC has no such
batching of its own, hence this module.

The wire form is a `...BatchRequest` (`call_id`, `start` or `cancel`, `metadata`) and a
`...BatchResponse` of events (`call_id`, `reply` or `end`), as in `GenerateBatch`. Each
call behaves as a call of its own would: the handler runs as it would for one, its errors
end that call only with the status and details a call of its own would end with, and the
caller gets a `grpc.aio.AioRpcError` of the same code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import propagate

from prism import tracing
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError, invalid

log = logging.getLogger(__name__)

# Runs one call: its request, its metadata and where its replies go, to the error it
# ended with (None: it completed).
CallRunner = Callable[[Any, dict[str, str], Callable[[Any], None]], Awaitable["PrismError | None"]]


class _Outbox:
    """Events waiting for the next message: whatever piled up while it was being sent
    goes out together."""

    def __init__(self) -> None:
        self.events: list = []
        self.ready = asyncio.Event()

    def put(self, event: object) -> None:
        self.events.append(event)
        self.ready.set()

    def take(self) -> list:
        self.ready.clear()
        events, self.events = self.events, []
        return events


def _end(error: PrismError | None) -> common_pb2.CallStatus:
    if error is None:
        return common_pb2.CallStatus(code=grpc.StatusCode.OK.value[0])
    status = error.to_status()
    details = dict(status.trailing_metadata).get("grpc-status-details-bin", b"")
    return common_pb2.CallStatus(code=status.code.value[0], message=status.details, details=details)


class MultiplexServer:
    """The server side of one batched method: runs each call and batches the events of all
    calls. What a call does (its handler and every per-call concern) is `run`'s."""

    def __init__(self, run: CallRunner, response_type: type, event_type: type) -> None:
        self.run = run
        self.response_type = response_type
        self.event_type = event_type
        self._sessions: set[_Outbox] = set()
        self._draining = False

    def drain(self) -> None:
        """Refuses new calls (UNAVAILABLE, so callers go elsewhere) and ends each stream
        once its calls are done."""
        self._draining = True
        for outbox in self._sessions:
            outbox.ready.set()

    async def serve(self, requests: AsyncIterator) -> AsyncIterator:
        """The batched responses of one stream, whose `requests` start and cancel calls."""
        event_type = self.event_type
        outbox = _Outbox()
        calls: dict[int, asyncio.Task] = {}

        async def run(call_id: int, start: object, metadata: dict[str, str]) -> None:
            # Each call runs in a task of its own, so its request id and span are its own.
            def emit(reply: object) -> None:
                outbox.put(event_type(call_id=call_id, reply=reply))

            try:
                error = await self.run(start, metadata, emit)
            except asyncio.CancelledError:
                return  # cancelled by the caller, who expects nothing more
            finally:
                calls.pop(call_id, None)
            outbox.put(event_type(call_id=call_id, end=_end(error)))

        async def read() -> None:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "start":
                    refused = None
                    if self._draining:
                        refused = PrismError(
                            grpc.StatusCode.UNAVAILABLE, "the server is shutting down"
                        )
                    elif request.call_id in calls:
                        refused = invalid(f"call {request.call_id} is running", "call_id")
                    if refused is not None:
                        outbox.put(event_type(call_id=request.call_id, end=_end(refused)))
                        continue
                    calls[request.call_id] = asyncio.create_task(
                        run(request.call_id, request.start, dict(request.metadata))
                    )
                elif action == "cancel" and request.call_id in calls:
                    calls[request.call_id].cancel()

        reader = asyncio.create_task(read())
        reader.add_done_callback(lambda _: outbox.ready.set())
        self._sessions.add(outbox)
        try:
            while True:
                await outbox.ready.wait()
                events = outbox.take()
                if events:
                    yield self.response_type(events=events)
                if reader.done() or self._draining:
                    if reader.done() and reader.exception() is not None:
                        raise reader.exception()
                    if not calls and not outbox.events:
                        return
        finally:
            self._sessions.discard(outbox)
            reader.cancel()
            for task in list(calls.values()):
                task.cancel()


class MultiplexCall:
    """One call on a `Client`'s stream, used as a `grpc.aio.UnaryStreamCall` is."""

    def __init__(self, client: Client, call_id: int) -> None:
        self._client = client
        self._id = call_id
        # Replies, then one last item: the `end` event, or the error to raise.
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False
        self._read_to_end = False
        self._deadline: asyncio.TimerHandle | None = None

    def __aiter__(self) -> MultiplexCall:
        return self

    async def __anext__(self) -> Any:
        if self._read_to_end:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._read_to_end = True
            raise item
        if item.WhichOneof("event") == "reply":
            reply = item.reply
            merge = self._client._merge
            # A reader that fell behind takes what piled up as one reply: each step of the
            # layers above then runs once for all of it (as vLLM's output collector merges
            # the deltas its consumer has not taken yet).
            while merge is not None and (more := self._peek()) is not None:
                if not merge(reply, more):
                    break
                self._items.popleft()
            return reply
        self._read_to_end = True
        if item.end.code == grpc.StatusCode.OK.value[0]:
            raise StopAsyncIteration
        raise _rpc_error(item.end)

    def ready(self) -> Any | None:
        """The next reply if it is here already, else None (also where what comes next
        is the call's end, which reading on with `async for` gives)."""
        reply = self._peek()
        if reply is not None:
            self._items.popleft()
        return reply

    def _peek(self) -> Any | None:
        item = self._items[0] if self._items else None
        if item is None or isinstance(item, BaseException) or item.WhichOneof("event") != "reply":
            return None
        return item.reply

    def _put(self, item: Any) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _deliver(self, event: Any) -> None:
        self._put(event)
        if event.WhichOneof("event") == "end":
            self._end()

    def _end(self, last: BaseException | None = None, tell_server: bool = False) -> bool:
        """Ends the call here (with `last` as its last item, if given); False if it had."""
        if self._ended:
            return False
        self._ended = True
        self._client._calls.pop(self._id, None)
        if self._deadline is not None:
            self._deadline.cancel()
        if tell_server:
            self._client._send(self._client._request_type(call_id=self._id, cancel={}))
        if last is not None:
            self._put(last)
        return True

    def _expire(self) -> None:
        # As gRPC's own deadline: the server stops, the caller reads DEADLINE_EXCEEDED.
        self._end(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), True)

    def done(self) -> bool:
        return self._ended

    def cancel(self) -> bool:
        """Ends the call here and on the server; reading on raises CancelledError."""
        return self._end(asyncio.CancelledError(), tell_server=True)


def _error(code: grpc.StatusCode, message: str, details: bytes = b"") -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata()
    if details:
        trailing.add("grpc-status-details-bin", details)
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, message)


def _rpc_error(status: common_pb2.CallStatus) -> grpc.aio.AioRpcError:
    code = next(c for c in grpc.StatusCode if c.value[0] == status.code)
    return _error(code, status.message, status.details)


def _stream_error(exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """What the calls on a broken stream fail with: its own error, but UNAVAILABLE where
    gRPC reports a write that failed as the stream broke as INTERNAL with no status from the
    peer (grpc/grpc#36066: the failed write hides the stream's real status). The peer or
    the way to it is gone, as for any other broken stream, and callers may go elsewhere."""
    if exc.code() == grpc.StatusCode.INTERNAL and not exc.trailing_metadata():
        return _error(
            grpc.StatusCode.UNAVAILABLE,
            f"the stream to the peer broke ({exc.details()}: {exc.debug_error_string()})",
        )
    return exc


class Client:
    """The caller side, one per peer: calls share one stream, opened at the first call
    and again after a stream ends. A stream that breaks fails every call on it with the
    stream's own error (UNAVAILABLE when the peer goes away)."""

    def __init__(
        self,
        open_stream: Callable[[AsyncIterator], Any],
        request_type: type,
        merge: Callable[[Any, Any], bool] | None = None,
    ):
        """`merge(a, b)`: adds reply `b` to reply `a` where one message can say both
        (True), else leaves `a` as it is (False); without it each reply comes alone."""
        self._open_stream = open_stream
        self._request_type = request_type
        self._merge = merge
        self._ids = itertools.count(1)
        self._calls: dict[int, MultiplexCall] = {}
        self._outgoing: asyncio.Queue | None = None
        self._reader: asyncio.Task | None = None

    def call(
        self,
        start: object,
        metadata: tuple[tuple[str, str], ...] = (),
        timeout: float | None = None,
    ) -> MultiplexCall:
        """Starts a call; past `timeout` seconds it fails with DEADLINE_EXCEEDED."""
        if self._reader is None or self._reader.done():
            self._outgoing = asyncio.Queue()
            stream = self._open_stream(self._requests(self._outgoing))
            self._reader = asyncio.create_task(self._read(stream))
        call_id = next(self._ids)
        call = self._calls[call_id] = MultiplexCall(self, call_id)
        carried = dict(metadata)
        if tracing.enabled():
            propagate.inject(carried)
        self._send(self._request_type(call_id=call_id, start=start, metadata=carried))
        if timeout is not None:
            call._deadline = asyncio.get_running_loop().call_later(timeout, call._expire)
        return call

    def _send(self, request: object) -> None:
        if self._outgoing is not None:
            self._outgoing.put_nowait(request)

    @staticmethod
    async def _requests(outgoing: asyncio.Queue) -> AsyncIterator:
        while True:
            yield await outgoing.get()

    async def _read(self, stream: Any) -> None:
        error: BaseException = _error(grpc.StatusCode.UNAVAILABLE, "the peer ended the stream")
        try:
            async for batch in stream:
                for event in batch.events:
                    call = self._calls.get(event.call_id)
                    if call is not None:
                        call._deliver(event)
        except grpc.aio.AioRpcError as exc:
            error = _stream_error(exc)
        finally:
            stream.cancel()
            calls = list(self._calls.values())
            for call in calls:
                call._end(error)
            if calls:
                log.warning("stream ended with %d calls open: %s", len(calls), error)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
