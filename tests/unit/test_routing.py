"""Routing among replicas: the policies (pure logic) and the processor's retry on another
replica, against small in-process EngineService servers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time

import grpc
import pytest

from prism.kv_index import prompt_keys
from prism.media.image import LoadedImage
from prism.media.modality import content_hash
from prism.media.prompt import PromptMedia
from prism.modes import MODES
from prism.proto.stage.v1 import (
    encoder_pb2,
    encoder_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    load_pb2,
    load_pb2_grpc,
    tensor_pb2,
)
from prism.proto.v1 import common_pb2, errors_pb2
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc.errors import PrismError
from prism.rpc.server import Server, start_server
from prism.runtime.ports import free_port
from prism.runtime.service import Service
from prism.services.processor.failover import StageCalls
from prism.services.processor.pipeline import Pipeline


def router(policy: str = "round-robin", **peers: list[str]) -> Router:
    return Router(StaticRegistry(peers), policy, rng=random.Random(7))


def test_round_robin_takes_each_role_in_turn():
    r = router(worker=["a:1", "b:1", "c:1"], encoder=["e:1", "f:1"])
    picks = [(r.pick("worker"), r.pick("encoder")) for _ in range(6)]
    assert [w for w, _ in picks] == ["a:1", "b:1", "c:1"] * 2
    assert [e for _, e in picks] == ["e:1", "f:1"] * 3


def test_random_spreads_over_every_replica():
    r = router("random", worker=["a:1", "b:1", "c:1"])
    counts = collections.Counter(r.pick("worker") for _ in range(300))
    assert set(counts) == {"a:1", "b:1", "c:1"} and min(counts.values()) > 60


def test_kv_sends_a_prompt_where_its_blocks_are_and_weighs_them_against_load():
    r = router("kv", worker=["a:1", "b:1"], decode=["d:1", "e:1"])
    keys = prompt_keys(list(range(40)), [], 8)  # Five blocks.
    r.index.receive("b:1", True, keys[:3], [])
    assert [r.pick("worker", keys=keys) for _ in range(3)] == ["b:1"] * 3
    # b would compute two blocks, a five: b until its open calls outweigh the three it saves.
    with r.using("b:1", blocks=3):
        assert r.pick("worker", keys=keys) == "b:1"  # 2 + 3 against 5: a tie, taken in turn
        assert r.pick("worker", keys=keys) == "a:1"
    with r.using("b:1", blocks=4):
        assert r.pick("worker", keys=keys) == "a:1"
    r.overlap_weight = 2.0  # Computing counts double: b's saving is worth 6.
    with r.using("b:1", blocks=5):
        assert r.pick("worker", keys=keys) == "b:1"
    # A prompt that shares nothing: by load, in turn where equal.
    other = prompt_keys(list(range(100, 140)), [], 8)
    assert {r.pick("worker", keys=other) for _ in range(2)} == {"a:1", "b:1"}
    # A replica excluded or gone from the index is scored as holding nothing.
    assert r.pick("worker", exclude=["b:1"], keys=keys) == "a:1"
    r.index.drop("b:1")
    with r.using("b:1", blocks=1):
        assert r.pick("worker", keys=keys) == "a:1"
    # Decode has no prefix cache to score: least loaded.
    r.report("d:1", True, in_flight=3)
    assert r.pick("decode", keys=keys) == "e:1"
    # An open call counts the blocks it computes, until its first reply: not those held.
    r.index.receive("a:1", True, keys[:4], [])
    with r.using("a:1", blocks=5, keys=keys) as computed:
        assert r._blocks["a:1"] == 1
        computed()
        assert r._blocks["a:1"] == 0
    assert r._blocks["a:1"] == 0


def test_kv_gives_each_media_item_an_encoder_and_moves_only_a_lost_ones_items():
    r = router("kv", encoder=["x:1", "y:1", "z:1"])
    items = [f"hash{i}" for i in range(60)]
    owners = {item: r.owner("encoder", item) for item in items}
    assert set(owners.values()) == {"x:1", "y:1", "z:1"}
    assert all(r.pick("encoder", content=item) == owners[item] for item in items)
    r.mark_down("y:1")
    moved = {item for item in items if r.owner("encoder", item) != owners[item]}
    assert moved == {item for item in items if owners[item] == "y:1"}
    assert {r.owner("encoder", item) for item in moved} == {"x:1", "z:1"}


def test_kv_sends_an_item_past_its_owner_only_when_the_owner_is_busier_by_the_slack():
    r = router("kv", encoder=["x:1", "y:1", "z:1"])
    item = "hash7"
    owner = r.owner("encoder", item)
    others = sorted({"x:1", "y:1", "z:1"} - {owner})
    r.report(owner, True, in_flight=r.encoder_slack)
    assert r.pick("encoder", content=item) == owner  # busier, within the slack
    r.report(owner, True, in_flight=r.encoder_slack + 1)
    r.report(others[0], True, in_flight=1)
    assert r.pick("encoder", content=item) == others[1]  # the least busy takes it
    # Calls this processor has open count as load too.
    r.report(owner, True, in_flight=0)
    with contextlib.ExitStack() as calls:
        for _ in range(r.encoder_slack + 1):
            calls.enter_context(r.using(owner))
        assert r.pick("encoder", content=item) != owner
    assert r.pick("encoder", content=item) == owner


def test_kv_sends_an_adapters_requests_to_its_owner_within_the_slack():
    r = router("kv", worker=["a:1", "b:1", "c:1"], decode=["d:1", "e:1"])
    adapters = [f"lora{i}" for i in range(30)]
    owners = {name: r.pick("worker", adapter=name) for name in adapters}
    # Adapters spread over the engines, each always to the same one, prefill and decode
    # alike; the base model's requests go by the policy alone.
    assert set(owners.values()) == {"a:1", "b:1", "c:1"}
    assert all(r.pick("worker", adapter=name) == owners[name] for name in adapters)
    assert len({r.pick("decode", adapter="lora0") for _ in range(4)}) == 1
    assert {r.pick("worker") for _ in range(6)} == {"a:1", "b:1", "c:1"}
    owner = owners["lora0"]
    r.report(owner, True, in_flight=r.adapter_slack)
    assert r.pick("worker", adapter="lora0") == owner  # busier, within the slack
    r.report(owner, True, in_flight=r.adapter_slack + 1)
    assert r.pick("worker", adapter="lora0") != owner
    # An owner lost: only its adapters move.
    r.mark_down(owner)
    moved = {name for name in adapters if r.pick("worker", adapter=name) != owners[name]}
    assert moved == {name for name in adapters if owners[name] == owner}
    # Other policies ignore adapters.
    rr = router(worker=["a:1", "b:1"])
    assert {rr.pick("worker", adapter="lora0") for _ in range(4)} == {"a:1", "b:1"}


def test_least_loaded_follows_reports_and_open_calls():
    r = router("least-loaded", worker=["a:1", "b:1", "c:1"])
    r.report("a:1", True, in_flight=5)
    r.report("b:1", True, in_flight=1)
    r.report("c:1", True, in_flight=1)
    # b and c tie: taken in turn.
    assert {r.pick("worker"), r.pick("worker")} == {"b:1", "c:1"}
    with r.using("b:1"), r.using("b:1"):
        assert r.pick("worker") == "c:1"
        with r.using("c:1"), r.using("c:1"), r.using("c:1"), r.using("c:1"), r.using("c:1"):
            assert r.pick("worker") == "b:1"
    assert r.load("b:1") == 1 and r.load("a:1") == 5


def test_a_probe_sent_before_a_call_failed_does_not_bring_the_replica_back():
    r = router(worker=["a:1", "b:1"])
    probed_at = time.monotonic()
    r.mark_down("a:1")
    # The probe's answer (sent while a was alive) arrives after the call failed.
    r.report("a:1", serving=True, probed_at=probed_at)
    assert {r.pick("worker") for _ in range(4)} == {"b:1"}
    # A probe sent since may.
    r.report("a:1", serving=True, probed_at=time.monotonic())
    assert {r.pick("worker") for _ in range(4)} == {"a:1", "b:1"}


def test_down_replicas_are_skipped_while_another_is_up():
    r = router(worker=["a:1", "b:1"])
    r.mark_down("a:1")
    assert {r.pick("worker") for _ in range(4)} == {"b:1"}
    r.report("b:1", serving=False)
    # Everything down: try them anyway rather than refuse, first the one only a probe
    # found down (perhaps still starting then) rather than the one a call failed on.
    assert {r.pick("worker") for _ in range(4)} == {"b:1"}
    r.mark_down("b:1")
    assert {r.pick("worker") for _ in range(4)} == {"a:1", "b:1"}
    r.report("a:1", serving=True)
    assert {r.pick("worker") for _ in range(4)} == {"a:1"}
    assert r.pick("worker", exclude=["a:1"]) == "b:1"
    with pytest.raises(PrismError) as info:
        r.pick("worker", exclude=["a:1", "b:1"])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError):
        router("fastest")


class FakeEngine:
    """Answers Generate with one token, or fails as told: before or after its first reply."""

    def __init__(self, token: int, fail: PrismError | None = None, after_first: bool = False):
        self.token, self.fail, self.after_first = token, fail, after_first
        self.service = Service(
            engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
            engine_pb2_grpc,
        )
        self.service.stream("Generate", self.replies)
        self.service.unary("Abort", self.abort)
        self.calls = 0
        self.requests: list[engine_pb2.GenerateRequest] = []

    async def replies(self, request):
        self.calls += 1
        self.requests.append(request)
        if self.fail and not self.after_first:
            raise self.fail
        prompt = engine_pb2.PromptUsage(prompt_tokens=len(request.prompt_token_ids))
        yield engine_pb2.GenerateResponse(token_ids=[self.token], first=prompt)
        if self.fail:
            raise self.fail
        finish = engine_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP)
        yield engine_pb2.GenerateResponse(last=finish)

    async def abort(self, request):
        return engine_pb2.EngineServiceAbortResponse(aborted=False)


async def engines(*fakes: FakeEngine) -> list[Server]:
    servers = []
    for fake in fakes:
        server = await start_server(
            "127.0.0.1:0",
            fake.service.add_to_server,
            ["prism.stage.v1.EngineService"],
            in_flight=lambda fake=fake: fake.calls,
        )
        await server.set_serving(["prism.stage.v1.EngineService"])
        servers.append(server)
    return servers


async def generate(*fakes: FakeEngine, dead: int = 0) -> tuple[list[int], Pipeline]:
    """Runs one EPD request over workers `fakes` (after `dead` addresses nobody serves)."""
    servers = await engines(*fakes)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(dead)]
    addresses += [f"127.0.0.1:{s.port}" for s in servers]
    pipeline = Pipeline(MODES["epd"], Router(StaticRegistry({"worker": addresses})))
    tokens: list[int] = []
    try:
        replies = pipeline.run(
            "r1", [1, 2, 3], PromptMedia(), common_pb2.SamplingParams(), StageCalls()
        )
        async for reply in replies:
            tokens += reply.token_ids
    finally:
        await pipeline.close()
        for server in servers:
            await server.server.stop(None)
    return tokens, pipeline


GONE = PrismError(grpc.StatusCode.UNAVAILABLE, "shutting down")


def test_a_replica_gone_before_its_first_reply_is_retried_on_another():
    tokens, pipeline = asyncio.run(generate(FakeEngine(7), dead=1))
    assert tokens == [7]
    dead = pipeline.router.registry.endpoints("worker")[0]
    # The dead one is out of rotation until a probe finds it serving.
    assert pipeline.router.pick("worker") != dead
    first, second = FakeEngine(1, fail=GONE), FakeEngine(2)
    assert asyncio.run(generate(first, second))[0] == [2]
    assert (first.calls, second.calls) == (1, 1)


def test_a_replica_that_comes_up_late_is_waited_for_not_failed():
    """Refused while it started, the replica's channel backs off before reconnecting; a
    call in that window gets the connection, not the stale refusal."""

    async def main() -> list[int]:
        address = f"127.0.0.1:{free_port()}"
        pipeline = Pipeline(MODES["epd"], Router(StaticRegistry({"worker": [address]})))
        # Probes of a replica not yet listening: each refusal lengthens the backoff.
        for _ in range(8):
            assert not await pipeline.ready()
            await asyncio.sleep(0.25)
        assert pipeline.peers.channel(address).get_state() != grpc.ChannelConnectivity.READY
        fake = FakeEngine(3)
        server = await start_server(
            address,
            fake.service.add_to_server,
            ["prism.stage.v1.EngineService"],
        )
        tokens: list[int] = []
        try:
            replies = pipeline.run(
                "r1", [1], PromptMedia(), common_pb2.SamplingParams(), StageCalls()
            )
            async for reply in replies:
                tokens += reply.token_ids
        finally:
            await pipeline.close()
            await server.server.stop(None)
        return tokens

    assert asyncio.run(main()) == [3]


def test_only_one_retry_and_only_before_the_first_reply():
    first, second = FakeEngine(1, fail=GONE), FakeEngine(2, fail=GONE)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate(first, second))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert (first.calls, second.calls) == (1, 1)
    # After a first token, another replica cannot take over: the error goes to the caller.
    first, second = FakeEngine(1, fail=GONE, after_first=True), FakeEngine(2)
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(generate(first, second))
    assert second.calls == 0


def test_errors_that_another_replica_would_repeat_are_not_retried():
    lost = PrismError(
        grpc.StatusCode.UNAVAILABLE, "KV gone", reason=errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED
    )
    for fail in (lost, PrismError(grpc.StatusCode.INVALID_ARGUMENT, "bad")):
        first, second = FakeEngine(1, fail=fail), FakeEngine(2)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate(first, second))
        assert info.value.code() == fail.code
        assert second.calls == 0


def test_probes_report_health_and_load():
    async def main() -> None:
        busy, idle = FakeEngine(1), FakeEngine(2)
        busy.calls = 4
        servers = await engines(busy, idle)
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        pipeline = Pipeline(
            MODES["epd"], Router(StaticRegistry({"worker": addresses}), "least-loaded")
        )
        assert await pipeline.ready()
        assert [pipeline.router.load(a) for a in addresses] == [4, 0]
        assert pipeline.router.pick("worker") == addresses[1]
        reply = await load_pb2_grpc.LoadServiceStub(pipeline.peers.channel(addresses[0])).GetLoad(
            load_pb2.GetLoadRequest()
        )
        assert reply.in_flight == 4
        await servers[1].set_serving(["prism.stage.v1.EngineService"], serving=False)
        assert await pipeline.ready()  # one replica is enough
        assert pipeline.router.pick("worker") == addresses[0]
        for server in servers:
            await server.server.stop(None)
        assert not await pipeline.ready()
        await pipeline.close()

    asyncio.run(main())


def test_a_stream_cut_mid_way_resumes_on_another_replica():
    async def main(limit: int) -> list[int]:
        first = FakeEngine(1, fail=GONE, after_first=True)
        second = FakeEngine(2)
        servers = await engines(first, second)
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        pipeline = Pipeline(MODES["epd"], Router(StaticRegistry({"worker": addresses})))
        sampling = common_pb2.SamplingParams(max_tokens=5, min_tokens=3)
        tokens: list[int] = []
        try:
            replies = pipeline.run("r1", [7, 8], PromptMedia(), sampling, StageCalls(), limit)
            async for reply in replies:
                tokens += reply.token_ids
        finally:
            await pipeline.close()
            for server in servers:
                await server.server.stop(None)
        (resumed,) = second.requests
        # The second replica continues from the prompt and the token already streamed.
        assert list(resumed.prompt_token_ids) == [7, 8, 1]
        assert resumed.request_id == "r1-migrated-1"
        assert (resumed.sampling.max_tokens, resumed.sampling.min_tokens) == (4, 2)
        return tokens

    assert asyncio.run(main(limit=1)) == [1, 2]
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(main(limit=0))


class FakePrefill(FakeEngine):
    """Prefills: one token and the KV transfer parameters; Abort frees nothing real."""

    async def replies(self, request):
        self.calls += 1
        self.requests.append(request)
        prompt = engine_pb2.PromptUsage(prompt_tokens=len(request.prompt_token_ids))
        yield engine_pb2.GenerateResponse(token_ids=[self.token], first=prompt)
        finish = engine_pb2.Finish(
            reason=common_pb2.FINISH_REASON_LENGTH,
            kv_transfer_params=engine_pb2.KvTransferParams(
                do_remote_prefill=True, remote_request_id=f"{request.request_id}-engine"
            ),
        )
        yield engine_pb2.GenerateResponse(last=finish)

    async def abort(self, request):
        return engine_pb2.EngineServiceAbortResponse(aborted=True)


async def migrated(
    pipeline: Pipeline,
    servers: list[Server],
    sampling: common_pb2.SamplingParams,
    images: tuple[LoadedImage, ...] = (),
) -> list[int]:
    """The tokens of one request on prompt [7, 8] (migrating once at most); then stops the
    pipeline and `servers`."""
    tokens: list[int] = []
    try:
        media = PromptMedia(list(images))
        async for reply in pipeline.run("r1", [7, 8], media, sampling, StageCalls(), 1):
            tokens += reply.token_ids
    finally:
        await pipeline.close()
        for server in servers:
            await server.server.stop(None)
    return tokens


def test_a_decode_gone_before_its_first_reply_is_not_retried_on_the_same_kv():
    """The lost decode may have read the prefill's KV, which prefill then freed: the
    request is prefilled again instead, with the token already streamed."""

    async def main() -> tuple[list[int], FakePrefill, FakeEngine, FakeEngine]:
        prefill, lost, spare = FakePrefill(5), FakeEngine(1, fail=GONE), FakeEngine(2)
        servers = await engines(prefill, lost, spare)
        prefill_at, lost_at, spare_at = (f"127.0.0.1:{s.port}" for s in servers)
        registry = StaticRegistry({"prefill": [prefill_at], "decode": [lost_at, spare_at]})
        sampling = common_pb2.SamplingParams(max_tokens=4, seed=1)
        tokens = await migrated(Pipeline(MODES["ep/d"], Router(registry)), servers, sampling)
        return tokens, prefill, lost, spare

    tokens, prefill, lost, spare = asyncio.run(main())
    assert lost.calls == 1
    # Prefilled twice: the second time from the prompt and the first token.
    assert [list(r.prompt_token_ids) for r in prefill.requests] == [[7, 8], [7, 8, 5]]
    (decoded,) = spare.requests
    assert decoded.kv_transfer_params.remote_request_id == "r1-migrated-1-engine"
    # The spare decode draws the first token again (here 2), which is dropped.
    assert tokens == [5, 5]


def test_a_decode_that_does_not_connect_is_passed_over_before_any_call():
    """Nothing was sent to it, so nothing read the KV: another decode takes the request
    with no second prefill."""

    async def main() -> tuple[list[int], FakePrefill, FakeEngine, Router]:
        prefill, spare = FakePrefill(5), FakeEngine(2)
        servers = await engines(prefill, spare)
        prefill_at, spare_at = (f"127.0.0.1:{s.port}" for s in servers)
        dead_at = f"127.0.0.1:{free_port()}"
        router = Router(StaticRegistry({"prefill": [prefill_at], "decode": [dead_at, spare_at]}))
        sampling = common_pb2.SamplingParams(max_tokens=4, seed=1)
        tokens = await migrated(Pipeline(MODES["ep/d"], router), servers, sampling)
        return tokens, prefill, spare, router

    tokens, prefill, spare, router = asyncio.run(main())
    assert [list(r.prompt_token_ids) for r in prefill.requests] == [[7, 8]]
    assert len(spare.requests) == 1
    assert tokens == [5]
    assert {router.pick("decode") for _ in range(4)} == {router.registry.endpoints("decode")[1]}


class FakeDecode(FakeEngine):
    """Decodes, unless the KV it is given is held by the prefill engine `lost`."""

    def __init__(self, token: int, lost: str):
        super().__init__(token)
        self.lost = lost

    async def replies(self, request):
        if request.kv_transfer_params.remote_engine_id == self.lost:
            self.calls += 1
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                "no KV",
                reason=errors_pb2.ERROR_REASON_KV_TRANSFER_FAILED,
            )
        async for reply in super().replies(request):
            yield reply


class NamedPrefill(FakePrefill):
    """A prefill whose KV parameters name it (its token) as their engine."""

    async def replies(self, request):
        async for reply in super().replies(request):
            if reply.HasField("last"):
                reply.last.kv_transfer_params.remote_engine_id = str(self.token)
            yield reply


def test_a_prefill_lost_with_its_kv_is_prefilled_again_elsewhere():
    async def main() -> tuple[list[int], NamedPrefill, NamedPrefill]:
        lost, spare = NamedPrefill(5), NamedPrefill(6)
        decode = FakeDecode(2, lost="5")
        servers = await engines(lost, spare, decode)
        lost_at, spare_at, decode_at = (f"127.0.0.1:{s.port}" for s in servers)
        registry = StaticRegistry({"prefill": [lost_at, spare_at], "decode": [decode_at]})
        sampling = common_pb2.SamplingParams(max_tokens=4, seed=1)
        tokens = await migrated(Pipeline(MODES["ep/d"], Router(registry)), servers, sampling)
        return tokens, lost, spare

    tokens, lost, spare = asyncio.run(main())
    assert [list(r.prompt_token_ids) for r in lost.requests] == [[7, 8]]
    # The spare prefill continues from the token the lost one streamed.
    assert [list(r.prompt_token_ids) for r in spare.requests] == [[7, 8, 5]]
    assert tokens == [5, 6]


class FakeEncoder:
    """Encodes every image into a handle that names this encoder and the image's bytes,
    or fails as told."""

    def __init__(self, name: str, fail: PrismError | None = None):
        self.name = name
        self.fail = fail
        self.calls = 0
        self.service = Service(
            encoder_pb2.DESCRIPTOR.services_by_name["EncoderService"],
            encoder_pb2_grpc,
        )
        self.service.unary("Encode", self.encode)

    async def encode(self, request):
        self.calls += 1
        if self.fail:
            raise self.fail
        handles = [
            encoder_pb2.EmbeddingHandle(
                embeddings=tensor_pb2.TensorDescriptor(
                    nixl=tensor_pb2.NixlLocation(agent_name=self.name)
                ),
                content_hash=image.data.decode(),
            )
            for image in request.images
        ]
        return encoder_pb2.EncodeResponse(embeddings=encoder_pb2.MediaEmbeddings(images=handles))


async def encoders(*fakes: FakeEncoder) -> list[Server]:
    servers = []
    for encoder in fakes:
        server = await start_server(
            "127.0.0.1:0", encoder.service.add_to_server, ["prism.stage.v1.EncoderService"]
        )
        await server.set_serving(["prism.stage.v1.EncoderService"])
        servers.append(server)
    return servers


def test_kv_sends_each_image_to_the_encoder_that_owns_it():
    async def main() -> None:
        fakes = [FakeEncoder(name) for name in "abc"]
        worker = FakeEngine(9)
        servers = await encoders(*fakes) + await engines(worker)
        *encoder_at, worker_at = (f"127.0.0.1:{s.port}" for s in servers)
        names = dict(zip(encoder_at, "abc", strict=True))
        registry = StaticRegistry({"encoder": encoder_at, "worker": [worker_at]})
        pipeline = Pipeline(MODES["e/pd"], Router(registry, "kv"))
        images: list[LoadedImage] = []
        owners: list[str] = []
        # Images enough for every encoder to own one (owners follow the ports, drawn free).
        while len(images) < 8 or len(set(owners)) < 3:
            images.append(LoadedImage(f"image{len(images)}".encode(), "image/png", 1, 1))
            owners.append(names[pipeline.router.owner("encoder", content_hash(images[-1].data))])

        async def run(*images: LoadedImage) -> list[tuple[str, str]]:
            """(encoder, image) of each embedding the worker was sent."""
            replies = pipeline.run("r", [7], PromptMedia(list(images)), common_pb2.SamplingParams(),
                                   StageCalls())  # fmt: skip
            async for _ in replies:
                pass
            handles = worker.requests[-1].embeddings.images
            return [(h.embeddings.nixl.agent_name, h.content_hash) for h in handles]

        try:
            # The images split over the three owners, one call each, back in prompt order.
            assert await run(*images) == [(o, f"image{i}") for i, o in enumerate(owners)]
            assert [f.calls for f in fakes] == [1, 1, 1]
            # Each alone goes where it went before, where its embeddings are cached.
            for image, owner in zip(images, owners, strict=True):
                assert (await run(image))[0][0] == owner
            # Its owner full, another encoder takes it.
            full = fakes["abc".index(owners[0])]
            full.fail = PrismError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
            tried = full.calls
            ((encoder, image),) = await run(images[0])
            assert (image, full.calls) == ("image0", tried + 1) and encoder != owners[0]
        finally:
            await pipeline.close()
            for server in servers:
                await server.server.stop(None)

    asyncio.run(main())


class EmbeddingsReader(FakeEngine):
    """Generates, unless its embeddings are held by the encoder `lost`."""

    def __init__(self, token: int, lost: str):
        super().__init__(token)
        self.lost = lost

    async def replies(self, request):
        if any(h.embeddings.nixl.agent_name == self.lost for h in request.embeddings.images):
            self.calls += 1
            raise PrismError(
                grpc.StatusCode.UNAVAILABLE,
                "unreadable",
                reason=errors_pb2.ERROR_REASON_EMBEDDINGS_UNAVAILABLE,
            )
        async for reply in super().replies(request):
            yield reply


def test_embeddings_lost_with_their_encoder_are_encoded_again_elsewhere():
    async def main() -> tuple[list[int], FakeEncoder, FakeEncoder, EmbeddingsReader]:
        lost, spare = FakeEncoder("lost"), FakeEncoder("spare")
        worker = EmbeddingsReader(9, lost="lost")
        servers = []
        for encoder in (lost, spare):
            server = await start_server(
                "127.0.0.1:0",
                encoder.service.add_to_server,
                ["prism.stage.v1.EncoderService"],
            )
            await server.set_serving(["prism.stage.v1.EncoderService"])
            servers.append(server)
        servers += await engines(worker)
        lost_at, spare_at, worker_at = (f"127.0.0.1:{s.port}" for s in servers)
        registry = StaticRegistry({"encoder": [lost_at, spare_at], "worker": [worker_at]})
        image = LoadedImage(b"png", "image/png", 1, 1)
        pipeline = Pipeline(MODES["e/pd"], Router(registry))
        tokens = await migrated(pipeline, servers, common_pb2.SamplingParams(), [image])
        return tokens, lost, spare, worker

    tokens, lost, spare, worker = asyncio.run(main())
    assert (lost.calls, spare.calls) == (1, 1)
    handles = worker.requests[-1].embeddings.images
    assert [h.embeddings.nixl.agent_name for h in handles] == ["spare"]
    assert tokens == [9]
