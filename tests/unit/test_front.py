"""A front: the gateway's HTTP door in the processor's own process and event loop,
opened and closed by the stage runtime as the stage serves and drains."""

import asyncio
import types

import httpx
import pytest
from grpc_health.v1 import health, health_pb2
from test_in_process_client import CHAT, Processor

from prism.config.commands import FrontStageConfig
from prism.config.common import ModelConfig
from prism.config.gateway import GatewayConfig, HttpConfig
from prism.gateway.door import HttpDoor
from prism.rpc.ports import PortInUse
from prism.runtime.ports import free_port
from prism.runtime.stage import Stage, StageFailed


async def _ready(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        for _ in range(200):
            try:
                if (await client.get("/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("the door never opened")


def test_the_http_door_calls_the_processor_in_its_loop_and_closes_when_told(monkeypatch):
    monkeypatch.delenv("PRISM_API_KEY", raising=False)
    processor = Processor()
    port = free_port()
    config = FrontStageConfig(model=ModelConfig("m"), http=HttpConfig(http_port=port))

    async def main() -> None:
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        server = types.SimpleNamespace(health=checks)
        door = HttpDoor(config, processor.service.handlers)
        serving = asyncio.create_task(door.serve(server))  # type: ignore[arg-type]
        base_url = f"http://127.0.0.1:{port}"
        await _ready(base_url)
        async with httpx.AsyncClient(base_url=base_url) as client:
            reply = await client.post("/v1/chat/completions", json=CHAT)
            assert reply.json()["choices"][0]["message"]["content"] == "abc"
            models = await client.get("/v1/models")
            assert [m["id"] for m in models.json()["data"]] == ["m"]
            # The processor turns NOT_SERVING: so does the door's /health.
            await checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            assert (await client.get("/health")).status_code == 503
        # The port is taken: a second door says so rather than exiting the process.
        with pytest.raises(PortInUse, match=f"HTTP port {port} on 127.0.0.1 is in use"):
            await HttpDoor(config, processor.service.handlers).serve(server)  # type: ignore[arg-type]
        door.close()
        await asyncio.wait_for(serving, 15)

    asyncio.run(main())


def test_the_door_closes_an_idle_connection_after_its_keep_alive(monkeypatch):
    monkeypatch.delenv("PRISM_API_KEY", raising=False)
    port = free_port()
    config = FrontStageConfig(model=ModelConfig("m"), http=HttpConfig(http_port=port),
                              gateway=GatewayConfig(http_keep_alive_s=0.3))  # fmt: skip

    async def main() -> None:
        checks = health.aio.HealthServicer()
        await checks.set("", health_pb2.HealthCheckResponse.SERVING)
        door = HttpDoor(config, Processor().service.handlers)
        serving = asyncio.create_task(door.serve(types.SimpleNamespace(health=checks)))  # type: ignore[arg-type]
        await _ready(f"http://127.0.0.1:{port}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: front\r\n\r\n")
        # The answer, then the end of the stream once the connection has idled 0.3 s.
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200")
        writer.close()
        door.close()
        await asyncio.wait_for(serving, 15)

    asyncio.run(main())


class Door:
    """A door that serves until closed, then finishes a request in flight; or one that
    cannot serve."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.server = None
        self.finished = False
        self._closed = asyncio.Event()

    async def serve(self, server) -> None:
        self.server = server
        if self.fails:
            await asyncio.sleep(0.1)
            raise OSError("port taken")
        await self._closed.wait()
        await asyncio.sleep(0.2)
        self.finished = True

    def close(self) -> None:
        self._closed.set()


def test_a_stage_that_loses_a_door_drains_its_other_doors_and_fails():
    config = FrontStageConfig(model=ModelConfig("m"))

    async def main() -> list[Door]:
        doors = [Door(), Door(fails=True)]
        stage = Stage(config, "processor")
        with pytest.raises(StageFailed, match="port taken"):
            await stage.serve([], ["epd"], doors=doors)
        return doors

    serving, failed = asyncio.run(main())
    # Both were given the stage's server; the one serving was closed, and the stage
    # waited for its requests before it ended.
    assert serving.server is failed.server is not None
    assert serving.finished
