"""The error model survives a real gRPC round trip; health, readiness, keepalive and the
static registry."""

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.serving import serving

from prism import cli
from prism.proto.v1 import errors_pb2, inference_pb2, inference_pb2_grpc
from prism.registry import StaticRegistry
from prism.routing import Router
from prism.rpc import options
from prism.rpc.channel import channel as open_channel
from prism.rpc.channel import check_health, sync_channel
from prism.rpc.errors import PrismError, invalid
from prism.rpc.ports import PortInUse, ensure_free
from prism.rpc.server import start_server
from prism.runtime.service import Service
from prism.services.processor.serving import _track_readiness


async def list_models(request):
    raise invalid(
        "bad thing", param="messages[0]", reason=errors_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE
    )


async def chat(request):
    yield inference_pb2.ChatResponse(text="a")
    raise RuntimeError("exploded")


def failing() -> Service:
    service = Service(
        inference_pb2.DESCRIPTOR.services_by_name["InferenceService"],
        inference_pb2_grpc,
    )
    service.unary("ListModels", list_models)
    service.stream("Chat", chat)
    return service


def test_errors_round_trip_with_details():
    async def run():
        server = await start_server(
            "127.0.0.1:0",
            failing().add_to_server,
            ["prism.v1.InferenceService"],
        )
        try:
            async with open_channel(f"127.0.0.1:{server.port}") as channel:
                stub = inference_pb2_grpc.InferenceServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListModels(inference_pb2.ListModelsRequest())
                error = PrismError.from_rpc_error(info.value)
                assert error.code == grpc.StatusCode.INVALID_ARGUMENT
                assert (error.message, error.param) == ("bad thing", "messages[0]")
                assert error.reason == errors_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE
                assert error.http_status == 415

                call = stub.Chat(inference_pb2.ChatRequest())
                assert (await call.read()).text == "a"
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call.read()
                error = PrismError.from_rpc_error(info.value)
                assert error.code == grpc.StatusCode.INTERNAL and "exploded" in error.message
                assert error.reason_name == "INTERNAL"
        finally:
            await server.server.stop(0)

    asyncio.run(run())


def test_every_status_code_names_a_reason_of_its_own():
    """Every ErrorInfo reason comes from prism.v1.ErrorReason: where no finer reason is
    given, the one that names the status code."""
    for code in grpc.StatusCode:
        if code is not grpc.StatusCode.OK:
            assert PrismError(code, "failed").reason_name == code.name
    named = PrismError(grpc.StatusCode.NOT_FOUND, "no", errors_pb2.ERROR_REASON_MODEL_NOT_FOUND)
    assert named.reason_name == "MODEL_NOT_FOUND"


def test_health_starts_not_serving_then_serves():
    async def run():
        server = await start_server("127.0.0.1:0", lambda s: None, ["x.Service"])
        address = f"127.0.0.1:{server.port}"
        try:
            assert not await asyncio.to_thread(check_health, address)
            await server.set_serving(["x.Service"])
            assert await asyncio.to_thread(check_health, address, "x.Service")
            server.draining = True
            await server.set_serving(["x.Service"], serving=False)
            await server.set_serving(["x.Service"])
            assert not await asyncio.to_thread(check_health, address, "x.Service")
        finally:
            await server.server.stop(0)

    asyncio.run(run())


def test_readiness_tolerates_isolated_probe_failures():
    probes = iter([True, False, False, True, False, False, False, True])
    reported: list[bool] = []

    class Pipeline:
        async def ready(self) -> bool:
            return next(probes)

    class Server:
        async def set_serving(self, services, serving=True):
            reported.append(serving)
            if len(reported) == 8:
                raise asyncio.CancelledError

    servicer = SimpleNamespace(ready=False)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(_track_readiness(Server(), Pipeline(), servicer, ["x.Service"], period=0))
    assert reported == [True, True, True, True, True, True, False, True]
    assert servicer.ready


def test_idle_connections_survive_keepalive(monkeypatch):
    # The real timings, 10 times faster: the client's pings every second, for 4 s.
    keepalive = ("grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
                 "grpc.http2.min_ping_interval_without_data_ms")  # fmt: skip

    def faster(options):
        return [(key, value // 10 if key in keepalive else value) for key, value in options]

    monkeypatch.setattr(options, "CHANNEL_OPTIONS", faster(options.CHANNEL_OPTIONS))
    monkeypatch.setattr(options, "SERVER_OPTIONS", faster(options.SERVER_OPTIONS))
    states: list[grpc.ChannelConnectivity] = []
    with serving(lambda server: None, ["idle"]) as address, sync_channel(address) as channel:
        channel.subscribe(states.append, try_to_connect=True)
        check = health_pb2_grpc.HealthStub(channel).Check
        up = health_pb2.HealthCheckResponse.SERVING
        assert check(health_pb2.HealthCheckRequest(service="idle")).status == up
        time.sleep(4)
        assert check(health_pb2.HealthCheckRequest(service="idle")).status == up
        # A server that took the pings for abuse would have cut the connection (GOAWAY).
        assert states[-1] == grpc.ChannelConnectivity.READY
        assert states.count(grpc.ChannelConnectivity.READY) == 1


def test_static_registry_round_robin():
    registry = StaticRegistry.from_pairs(["worker=a:1", "worker=b:2", "processor=c:3"])
    router = Router(registry)
    assert [router.pick("worker") for _ in range(4)] == ["a:1", "b:2", "a:1", "b:2"]
    assert registry.endpoints("processor") == ["c:3"]
    with pytest.raises(PrismError) as info:
        router.pick("encoder")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(ValueError):
        StaticRegistry.from_pairs(["worker"])


def test_prism_health_says_whether_a_stage_serves(monkeypatch, capsys):
    with serving(lambda s: None, ["x.Service"]) as address:
        assert cli.main(["health", address]) == 0
    assert cli.main(["health", address, "--timeout", "0.5"]) == 1
    # The gateway's /health: 503 until it has a processor.
    with http_server(503) as url:
        assert cli.main(["health", url]) == 1
    with http_server(200) as url:
        assert cli.main(["health", url]) == 0
    # A check of nothing fails: it would call any container healthy.
    monkeypatch.delenv("PRISM_HEALTH", raising=False)
    for argv in (["health", ""], ["health"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
        assert "nothing to check" in capsys.readouterr().err


@contextlib.contextmanager
def http_server(status: int) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/health"
    finally:
        server.shutdown()
        thread.join()


def test_a_port_another_process_listens_on_is_refused_unless_both_share_it():
    async def run():
        first = await start_server("127.0.0.1:0", lambda s: None, ["x.Service"])
        try:
            # gRPC would set SO_REUSEPORT and take half of the first one's connections.
            with pytest.raises(PortInUse, match=f"gRPC port {first.port} on 127.0.0.1"):
                await start_server(f"127.0.0.1:{first.port}", lambda s: None, ["x.Service"])
        finally:
            await first.server.stop(0)
        one = await start_server("127.0.0.1:0", lambda s: None, ["x.Service"], reuse_port=True)
        port = one.port
        other = await start_server(
            f"127.0.0.1:{port}", lambda s: None, ["x.Service"], reuse_port=True
        )
        shared = [one, other]
        try:
            assert {server.port for server in shared} == {port}
            with pytest.raises(PortInUse):
                ensure_free("gRPC", "127.0.0.1", port)
        finally:
            for server in shared:
                await server.server.stop(0)

    asyncio.run(run())
