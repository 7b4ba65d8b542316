"""Many calls over one gRPC stream (prism.rpc.multiplex), served by the stage runtime
(prism.runtime.service) on a real loopback server."""

import asyncio
import contextlib

import grpc
import pytest

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc
from prism.rpc import multiplex
from prism.rpc.channel import channel as open_channel
from prism.rpc.errors import PrismError, invalid
from prism.rpc.server import start_server
from prism.runtime.clients import merge_generated
from prism.runtime.service import Service


class Engine:
    """Each request's prompt says what to do: [n] streams n tokens once `go` is set, [0]
    fails with INVALID_ARGUMENT, and [1000] or more streams until cancelled."""

    def __init__(self) -> None:
        self.go = asyncio.Event()
        self.service = Service(
            engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
            engine_pb2_grpc,
        )
        self.service.stream("Generate", self.replies)
        self.cancelled: list[str] = []
        self.started = 0
        # The messages of the batched stream, as the client read them.
        self.sent: list[engine_pb2.GenerateBatchResponse] = []

    async def replies(self, request):
        (n,) = request.prompt_token_ids
        if n == 0:
            raise invalid("no tokens asked for", param="prompt_token_ids")
        self.started += 1
        try:
            await self.go.wait()
            for token in range(n if n < 1000 else 10**9):
                yield engine_pb2.GenerateResponse(token_ids=[token])
                await asyncio.sleep(0.01 if n >= 1000 else 0)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


class Recorded:
    """A batched stream whose messages are kept as they are read."""

    def __init__(self, call, sent: list):
        self.call, self.sent = call, sent

    async def __aiter__(self):
        async for batch in self.call:
            self.sent.append(batch)
            yield batch

    def cancel(self) -> bool:
        return self.call.cancel()


@contextlib.asynccontextmanager
async def engine(merge=None):
    servicer = Engine()
    server = await start_server(
        "127.0.0.1:0",
        servicer.service.add_to_server,
        ["prism.stage.v1.EngineService"],
    )
    channel = open_channel(f"127.0.0.1:{server.port}")
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    client = multiplex.Client(
        lambda requests: Recorded(stub.GenerateBatch(requests), servicer.sent),
        engine_pb2.GenerateBatchRequest,
        merge,
    )
    try:
        yield servicer, client, server
    finally:
        await client.close()
        await channel.close()
        await server.server.stop(None)


async def started(servicer: Engine, count: int) -> None:
    for _ in range(200):
        if servicer.started == count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{servicer.started} calls started, not {count}")


def request(request_id: str, n: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=[n])


async def tokens(call: multiplex.MultiplexCall) -> list[int]:
    return [t async for reply in call for t in reply.token_ids]


def test_calls_ready_together_travel_in_one_message():
    async def main() -> None:
        async with engine() as (servicer, client, _):
            calls = [client.call(request(f"r{i}", 3)) for i in range(4)]
            await started(servicer, 4)
            servicer.go.set()
            assert await asyncio.gather(*map(tokens, calls)) == [[0, 1, 2]] * 4
            # 4 calls x (3 replies + their end) in fewer messages than events, and the
            # first message already carries every call's first reply.
            events = sum(len(b.events) for b in servicer.sent)
            assert events == 16 and len(servicer.sent) < events
            assert {e.call_id for e in servicer.sent[0].events} == {1, 2, 3, 4}

    asyncio.run(main())


async def delivered(call: multiplex.MultiplexCall) -> None:
    for _ in range(200):
        if call.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call's replies did not all arrive")


def test_a_reader_that_falls_behind_takes_what_piled_up_as_one_reply():
    async def main() -> None:
        async with engine(merge_generated) as (servicer, client, _):
            servicer.go.set()
            late = client.call(request("late", 5))
            await delivered(late)
            assert [list(reply.token_ids) async for reply in late] == [[0, 1, 2, 3, 4]]
            # One that reads as they come loses nothing either.
            assert await tokens(client.call(request("k", 3))) == [0, 1, 2]

    asyncio.run(main())


def test_without_merge_each_reply_comes_alone_and_ready_takes_them_without_waiting():
    async def main() -> None:
        async with engine() as (servicer, client, _):
            servicer.go.set()
            call = client.call(request("r", 3))
            await delivered(call)
            assert [list(call.ready().token_ids) for _ in range(3)] == [[0], [1], [2]]
            # Then the end, which only reading on gives.
            assert call.ready() is None
            assert [reply async for reply in call] == []

    asyncio.run(main())


def test_a_failed_call_ends_alone_with_its_status_and_details():
    async def main() -> None:
        async with engine() as (servicer, client, _):
            servicer.go.set()
            good = client.call(request("good", 2))
            bad = client.call(request("bad", 0))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(bad)
            error = PrismError.from_rpc_error(info.value)
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (error.message, error.param) == ("no tokens asked for", "prompt_token_ids")
            assert await tokens(good) == [0, 1]
            # The stream goes on serving.
            assert await tokens(client.call(request("after", 1))) == [0]

    asyncio.run(main())


def test_cancel_and_deadline_end_the_call_on_the_server():
    async def main() -> None:
        async with engine() as (servicer, client, _):
            servicer.go.set()
            endless = client.call(request("cancelled", 1000))
            assert (await endless.__anext__()).token_ids == [0]
            assert endless.cancel() and not endless.cancel()
            with pytest.raises(asyncio.CancelledError):
                await endless.__anext__()
            late = client.call(request("late", 1000), timeout=0.3)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(late)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            for _ in range(100):
                if len(servicer.cancelled) == 2:
                    break
                await asyncio.sleep(0.05)
            assert servicer.cancelled == ["cancelled", "late"]

    asyncio.run(main())


def test_a_lost_stream_fails_its_calls_unavailable_and_the_next_call_reconnects():
    async def main() -> None:
        async with engine() as (servicer, client, server):
            servicer.go.set()
            assert await tokens(client.call(request("first", 1))) == [0]
            endless = client.call(request("endless", 1000))
            await endless.__anext__()
            # A peer that goes away mid-stream (here: it stops, with no grace).
            await server.server.stop(None)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(endless)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(client.call(request("nobody", 1)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


class BrokenStream:
    """A stream that fails at once with `error`, as gRPC's does when its peer is lost."""

    def __init__(self, error: grpc.aio.AioRpcError) -> None:
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self) -> bool:
        return True


@pytest.mark.parametrize(
    "trailing,code",
    [
        # What grpc.aio reports when a write fails as the stream breaks (grpc/grpc#36066).
        ((), grpc.StatusCode.UNAVAILABLE),
        # A status the peer sent is the peer's word.
        ((("grpc-status-details-bin", b"x"),), grpc.StatusCode.INTERNAL),
    ],
    ids=["gRPC's own INTERNAL", "the peer's INTERNAL"],
)
def test_a_stream_broken_by_a_failed_write_fails_its_calls_unavailable(trailing, code):
    async def main() -> grpc.StatusCode:
        error = grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*trailing),
            "Internal error from Core",
        )
        client = multiplex.Client(lambda _: BrokenStream(error), engine_pb2.GenerateBatchRequest)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tokens(client.call(request("lost", 1)))
        await client.close()
        return info.value.code()

    assert asyncio.run(main()) == code


def test_a_draining_server_refuses_new_calls_and_ends_the_stream_when_done():
    async def main() -> None:
        async with engine() as (servicer, client, _):
            running = client.call(request("running", 3))
            await started(servicer, 1)
            servicer.service.drain()
            refused = client.call(request("refused", 1))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(refused)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            servicer.go.set()
            assert await tokens(running) == [0, 1, 2]
            # Nor does a new stream get any.
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await tokens(client.call(request("next", 1)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_a_call_id_in_use_is_refused_on_the_raw_stream():
    """What any gRPC client sees on the wire: one message per batch of events."""

    async def main() -> list[tuple[int, str, int]]:
        async with (
            engine() as (servicer, _, server),
            open_channel(f"127.0.0.1:{server.port}") as channel,
        ):
            stream = engine_pb2_grpc.EngineServiceStub(channel).GenerateBatch()
            start = request("r", 1000)
            await stream.write(engine_pb2.GenerateBatchRequest(call_id=7, start=start))
            await started(servicer, 1)
            await stream.write(engine_pb2.GenerateBatchRequest(call_id=7, start=start))
            # The first call waits for `go`, which never comes: the one event is the refusal.
            events = list((await stream.read()).events)
            await stream.write(engine_pb2.GenerateBatchRequest(call_id=7, cancel={}))
            await stream.done_writing()
            while (batch := await stream.read()) is not grpc.aio.EOF:
                events += batch.events
            return [(e.call_id, e.WhichOneof("event"), e.end.code) for e in events]

    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    # The refusal ends nothing but itself; the stream ends once the running call is gone.
    assert asyncio.run(main()) == [(7, "end", invalid)]


def test_merged_replies_keep_the_first_and_the_last_message_their_own():
    usage = engine_pb2.PromptUsage(prompt_tokens=9)
    first = engine_pb2.GenerateResponse(token_ids=[1], first=usage)
    plain = engine_pb2.GenerateResponse(token_ids=[2], logprobs=[engine_pb2.EngineLogprobs(rank=3)])
    last = engine_pb2.GenerateResponse(token_ids=[3], last=engine_pb2.Finish(reason=1))
    assert merge_generated(first, plain)
    assert (list(first.token_ids), first.first.prompt_tokens) == ([1, 2], 9)
    assert [p.rank for p in first.logprobs] == [3]
    # The prompt's message and the end's both say where they stand: not one message.
    assert not merge_generated(first, last)
    assert list(first.token_ids) == [1, 2]
    middle = engine_pb2.GenerateResponse(token_ids=[2])
    assert merge_generated(middle, last)
    assert (list(middle.token_ids), middle.last.reason) == ([2, 3], 1)
