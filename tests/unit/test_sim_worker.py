"""The simulated worker's `EngineService` and `KvEventsService` over real gRPC, in
process: what a processor sees of a vLLM worker in each role — usage, cached prompt
tokens, block keys as the processor computes them, prefill's hand-off read and freed by a
decode, and the errors of bad requests."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prism.config.sim import SimConfig
from prism.kv_index import lay_out, prompt_keys
from prism.media.modality import content_hash
from prism.modes import EngineRole
from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc, kv_events_pb2
from prism.proto.v1 import common_pb2, errors_pb2
from prism.rpc.errors import PrismError
from prism.rpc.server import Server, start_server
from prism.runtime.ports import free_port
from prism.services.sim.engine import SimEngine
from prism.services.sim.servicer import SimServicer
from prism.services.worker.kv_publisher import KvPublisher

IMAGE = 99
MEDIA_TOKENS = 6
CONFIG = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=4)
PICTURE = b"\x89PNG not decoded by a simulation"


class Worker:
    """A simulated worker of `role` serving on loopback."""

    def __init__(self, role: EngineRole) -> None:
        self.engine = SimEngine(CONFIG, self._changed)
        self.publisher = KvPublisher(self.engine.pool.keys, lambda: CONFIG.block_size)
        self.port = free_port()
        self.servicer = SimServicer(self.engine, role, {"image": IMAGE}, MEDIA_TOKENS, 1e6,
                                    ("127.0.0.1", self.port), kv_lease_s=30)  # fmt: skip
        self.server: Server | None = None
        self.channel: grpc.aio.Channel | None = None

    def _changed(self, stored: list[int], removed: list[int]) -> None:
        self.publisher.publish(stored, removed)

    async def __aenter__(self) -> Worker:
        def register(server: grpc.aio.Server) -> None:
            self.servicer.service.add_to_server(server)
            self.publisher.service.add_to_server(server)

        self.server = await start_server(f"127.0.0.1:{self.port}", register, [])
        self.engine.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.channel is not None and self.server is not None
        await self.channel.close()
        await self.server.server.stop(0)
        await self.engine.stop()

    @property
    def stub(self) -> engine_pb2_grpc.EngineServiceStub:
        return engine_pb2_grpc.EngineServiceStub(self.channel)

    async def generate(self, request: engine_pb2.GenerateRequest) -> list:
        return [reply async for reply in self.stub.Generate(request)]


def request(name: str, max_tokens: int = 5, **fields) -> engine_pb2.GenerateRequest:
    prompt = [1, 5, 6, IMAGE, 7, 8, 9, 10, 11, 12]
    message = engine_pb2.GenerateRequest(
        request_id=name,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=3),
        **fields,
    )
    if "kv_transfer_params" not in fields and "layouts" not in fields:
        message.files.images.add(data=PICTURE)
    return message


def tokens(replies: list) -> list[int]:
    return [t for reply in replies for t in reply.token_ids]


def failure(call) -> PrismError:
    async def main():
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            return PrismError.from_rpc_error(exc)
        raise AssertionError("the call did not fail")

    return main()


def test_an_aggregated_worker_answers_and_keys_its_blocks_as_the_processor_does():
    async def main() -> None:
        async with Worker(EngineRole.AGGREGATED) as worker:
            replies = await worker.generate(request("a"))
            assert replies[0].first.prompt_tokens == 9 + MEDIA_TOKENS
            assert replies[0].first.cached_tokens == 0
            assert replies[-1].last.reason == common_pb2.FINISH_REASON_LENGTH
            assert len(tokens(replies)) == 5
            laid, spans = lay_out(
                request("a").prompt_token_ids, {IMAGE},
                {IMAGE: [(content_hash(PICTURE), MEDIA_TOKENS)]},
            )  # fmt: skip
            expected = prompt_keys(laid, spans, CONFIG.block_size)
            assert len(expected) == 3
            stream = worker.publisher.subscribe(kv_events_pb2.SubscribeRequest())
            snapshot = await anext(stream)
            await stream.aclose()
            assert snapshot.snapshot and sorted(snapshot.stored) == sorted(expected)
            assert snapshot.block_size == CONFIG.block_size
            again = await worker.generate(request("b"))
            assert again[0].first.cached_tokens == 3 * CONFIG.block_size
            assert worker.engine.pool.used() == 0

    asyncio.run(main())


def test_a_decode_reads_prefills_kv_once_and_prefill_frees_it():
    async def main() -> None:
        async with (
            Worker(EngineRole.ENCODE_PREFILL) as prefill,
            Worker(EngineRole.DECODE) as decode,
        ):
            first = await prefill.generate(request("r", max_tokens=6))
            assert len(tokens(first)) == 1
            finish = first[-1].last
            kv = finish.kv_transfer_params
            assert (kv.remote_host, kv.remote_port) == ("127.0.0.1", prefill.port)
            assert kv.remote_num_tokens == 9 + MEDIA_TOKENS
            assert [(i.uuid, i.num_tokens) for i in finish.layouts.images] == [
                (content_hash(PICTURE), MEDIA_TOKENS)
            ]
            assert "r" in prefill.engine.held and prefill.engine.pool.used() > 0
            follow = request("r", max_tokens=6, kv_transfer_params=kv, layouts=finish.layouts)
            rest = await decode.generate(follow)
            # Decode draws the first token again, then the rest.
            assert tokens(rest)[0] == tokens(first)[0] and len(tokens(rest)) == 6
            assert rest[0].first.prompt_tokens == 9 + MEDIA_TOKENS
            assert not prefill.engine.held and prefill.engine.pool.used() == 0
            error = await failure(lambda: decode.generate(follow))
            assert error.code == grpc.StatusCode.UNAVAILABLE
            assert error.reason == errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED
            assert decode.engine.pool.used() == 0

    asyncio.run(main())


def test_abort_frees_a_prefill_that_no_decode_will_read():
    async def main() -> None:
        async with Worker(EngineRole.PREFILL) as prefill:
            embedded = request("p")
            embedded.ClearField("files")
            handle = embedded.embeddings.images.add(content_hash="e1")
            handle.embeddings.shape.extend([MEDIA_TOKENS, 64])
            replies = await prefill.generate(embedded)
            assert replies[0].first.prompt_tokens == 9 + MEDIA_TOKENS
            assert prefill.engine.pool.used() > 0
            abort = engine_pb2.EngineServiceAbortRequest(request_id="p")
            assert (await prefill.stub.Abort(abort)).aborted
            assert not (await prefill.stub.Abort(abort)).aborted
            assert prefill.engine.pool.used() == 0

    asyncio.run(main())


def test_a_cancelled_call_frees_its_blocks():
    async def main() -> None:
        async with Worker(EngineRole.AGGREGATED) as worker:
            call = worker.stub.Generate(request("c", max_tokens=100_000))
            await call.read()
            assert worker.engine.pool.used() > 0
            call.cancel()
            for _ in range(200):
                if not worker.engine.pool.used() and not worker.servicer.in_flight():
                    break
                await asyncio.sleep(0.01)
            assert worker.engine.pool.used() == 0 and not worker.servicer.in_flight()

    asyncio.run(main())


@pytest.mark.parametrize(
    "change, param",
    [
        (lambda r: r.ClearField("request_id"), "request_id"),
        (lambda r: r.ClearField("prompt_token_ids"), "prompt_token_ids"),
        (lambda r: r.prompt_token_ids.append(IMAGE), "prompt_token_ids"),
        (lambda r: setattr(r.sampling, "logprobs", 2), "logprobs"),
        (lambda r: r.kv_transfer_params.SetInParent(), "kv_transfer_params"),
        (lambda r: r.prompt_token_ids.extend([3] * CONFIG.max_model_len), "prompt_token_ids"),
    ],
)
def test_bad_requests_are_invalid_arguments_and_the_worker_serves_on(change, param):
    async def main() -> None:
        async with Worker(EngineRole.AGGREGATED) as worker:
            bad = request("bad")
            change(bad)
            error = await failure(lambda: worker.generate(bad))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert error.param == param
            assert len(tokens(await worker.generate(request("good")))) == 5
            assert worker.engine.pool.used() == 0

    asyncio.run(main())
