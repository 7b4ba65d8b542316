"""Contract tests of the Consul registry backend.

They run against `tests/support/consul_double.py`, a double of Consul's HTTP API written for the
suite, because no Consul binary can be installed where the tests run. The double decodes
and checks requests the way the Consul agent does, runs the gRPC health checks itself and
answers blocking queries; compose.yaml runs against the real agent.
"""

from __future__ import annotations

import asyncio
import itertools

import consul
import pytest
from support.consul_double import ConsulDouble, DecodeError, decode, duration
from support.waiting import until

from prism.registry import Instance, discovery_tags
from prism.registry.consul import ConsulRegistry
from prism.rpc.server import Server, start_server
from prism.runtime.ports import free_port

TOKEN = "b1gs3cret-acl-token"


async def health_server() -> Server:
    """A gRPC server with nothing but health checking, serving."""
    server = await start_server("127.0.0.1:0", lambda s: None, ["prism.test"])
    await server.set_serving(["prism.test"])
    return server


def registry(double: ConsulDouble, **kwargs) -> ConsulRegistry:
    host, port = double.address.split(":")
    kwargs.setdefault("token", TOKEN)
    return ConsulRegistry(host, int(port), check_interval="100ms", check_timeout="1s",
                          deregister_after="30s", wait="2s", **kwargs)  # fmt: skip


def test_the_double_decodes_as_consul_does():
    # Field names match whatever their spelling; unknown fields are refused.
    schema = {"Name": None, "Checks": [{"GRPC": None, "DeregisterCriticalServiceAfter": None}]}
    body = {"name": "a", "checks": [{"grpc": "h:1", "deregister_critical_service_after": "1m"}]}
    assert decode(body, schema) == {
        "Name": "a",
        "Checks": [{"GRPC": "h:1", "DeregisterCriticalServiceAfter": "1m"}],
    }
    with pytest.raises(DecodeError):
        decode({"Nmae": "a"}, {"Name": None})
    assert duration("1m30s") == 90 and duration("500ms") == 0.5
    with pytest.raises(DecodeError):
        duration("5")


def test_register_sends_the_service_definition_consul_expects():
    async def main() -> None:
        server = await health_server()
        reg = registry(double)
        address = f"127.0.0.1:{server.port}"
        await reg.register(Instance("worker", address, "tiny-llava", ("epd", "e/pd")))
        (request,) = [r for r in double.requests if r.path == "/v1/agent/service/register"]
        assert request.method == "PUT" and request.headers["x-consul-token"] == TOKEN
        service_id = f"prism-worker-127-0-0-1-{server.port}"
        assert double.services[service_id].definition == {
            "Name": "prism-worker",
            "ID": service_id,
            "Address": "127.0.0.1",
            "Port": server.port,
            "Tags": ["role=worker", "model=tiny-llava", "mode=epd", "mode=e/pd"],
            "Meta": {"role": "worker", "model": "tiny-llava", "modes": "epd,e/pd",
                     "address": address},
            "Checks": [{"GRPC": address, "Interval": "100ms", "Timeout": "1s",
                        "DeregisterCriticalServiceAfter": "30s"}],
        }  # fmt: skip
        # Consul ran the gRPC check against the server's own grpc.health.v1.
        assert await until(lambda: double.passing("prism-worker") == [service_id])
        await reg.close()
        assert double.requests[-1].path == f"/v1/agent/service/deregister/{service_id}"
        assert service_id not in double.services
        await server.server.stop(None)

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_gateway_registers_an_http_check():
    async def main() -> None:
        reg = registry(double)
        await reg.register(Instance("gateway", "127.0.0.1:8000", health="http"))
        (registered,) = double.services.values()
        assert registered.definition["Checks"] == [
            {"HTTP": "http://127.0.0.1:8000/health", "Interval": "100ms", "Timeout": "1s",
             "DeregisterCriticalServiceAfter": "30s"}
        ]  # fmt: skip
        await reg.close()

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_a_plaintext_health_port_is_checked_instead_of_the_service_port():
    async def main() -> None:
        port = free_port()
        server = await start_server(
            "127.0.0.1:0", lambda s: None, ["prism.test"], health_address=f"127.0.0.1:{port}"
        )
        await server.set_serving(["prism.test"])
        reg = registry(double)
        await reg.register(Instance("worker", f"127.0.0.1:{server.port}", health_port=port))
        (registered,) = double.services.values()
        # Under mutual TLS the service port wants a client certificate, which Consul lacks.
        assert registered.definition["Checks"] == [
            {"GRPC": f"127.0.0.1:{port}", "Interval": "100ms", "Timeout": "1s",
             "DeregisterCriticalServiceAfter": "30s"}
        ]  # fmt: skip
        assert await until(lambda: len(double.passing("prism-worker")) == 1)
        await reg.close()
        await server.stop(None)

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_processes_sharing_an_address_register_apart():
    """The fronts of `prism serve --front-workers`: one leaving takes only its own entry."""

    async def main() -> None:
        server = await health_server()
        address = f"127.0.0.1:{server.port}"
        shared = [registry(double, id_suffix=f"front-{i}") for i in range(2)]
        for reg in shared:
            await reg.register(Instance("processor", address))
        plain = f"prism-processor-127-0-0-1-{server.port}"
        assert sorted(double.services) == [f"{plain}-front-0", f"{plain}-front-1"]
        await shared[0].close()
        assert list(double.services) == [f"{plain}-front-1"]
        await shared[1].close()
        await server.server.stop(None)

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_a_missing_token_is_refused():
    async def main() -> None:
        reg = registry(double, token=None)
        with pytest.raises(consul.ACLPermissionDenied):
            await reg.register(Instance("worker", "127.0.0.1:1"))
        await reg.close()

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_discovery_lists_passing_instances_and_follows_them_with_blocking_queries():
    async def main() -> None:
        a, b, c, d = [await health_server() for _ in range(4)]
        reg = registry(double)
        # c serves another model, d another mode: both pass their checks, neither is listed.
        for server, model, mode in ((a, "tiny", "epd"), (b, "tiny", "epd"),
                                    (c, "other", "epd"), (d, "tiny", "e/pd")):  # fmt: skip
            await reg.register(Instance("worker", f"127.0.0.1:{server.port}", model, (mode,)))
        assert await until(lambda: len(double.passing("prism-worker")) == 4)
        watcher = registry(double)
        await watcher.watch("worker", discovery_tags("tiny", "epd"))
        both = sorted([f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"])
        assert await until(lambda: sorted(watcher.endpoints("worker")) == both)
        # A replica that stops serving leaves the list once its check fails.
        await b.set_serving(["prism.test"], serving=False)
        assert await until(lambda: watcher.endpoints("worker") == [f"127.0.0.1:{a.port}"])
        await b.set_serving(["prism.test"])
        assert await until(lambda: sorted(watcher.endpoints("worker")) == both)
        # One that is gone too.
        await a.server.stop(None)
        assert await until(lambda: watcher.endpoints("worker") == [f"127.0.0.1:{b.port}"])
        # Quiet for a while: the watcher waits in blocking queries instead of polling. Time
        # passes on purpose: a little over one blocking wait (2s), which a polling watcher
        # would fill with queries.
        before = len(double.queries("prism-worker"))
        await asyncio.sleep(2.5)
        assert len(double.queries("prism-worker")) - before <= 2
        queries = double.queries("prism-worker")
        assert all(q.query["tag"] == ["model=tiny", "mode=epd"] for q in queries)
        assert all(q.query["passing"] == ["1"] for q in queries)
        assert "index" not in queries[0].query
        for query in queries[1:]:
            assert int(query.query["index"][0]) >= 1 and query.query["wait"] == ["2s"]
        await watcher.close()
        await reg.close()
        for server in (b, c, d):
            await server.server.stop(None)

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_connect_registers_a_sidecar_and_routes_through_its_upstreams():
    async def main() -> None:
        reg = registry(double, connect=True, upstreams={"worker": 21001, "encoder": 21002})
        await reg.register(Instance("processor", "127.0.0.1:50050", "tiny", ("e/pd",)))
        processor = double.services["prism-processor-127-0-0-1-50050"].definition
        assert processor["Connect"] == {
            "SidecarService": {"Proxy": {"Upstreams": [
                {"DestinationName": "prism-encoder", "LocalBindPort": 21002},
                {"DestinationName": "prism-worker", "LocalBindPort": 21001},
            ]}}
        }  # fmt: skip
        sidecar = double.services["prism-processor-127-0-0-1-50050-sidecar-proxy"].definition
        assert sidecar["Kind"] == "connect-proxy"
        assert sidecar["Name"] == "prism-processor-sidecar-proxy"
        # Calls to a role with an upstream go to the sidecar's local listener; Consul is
        # not asked. Time passes on purpose: a watch would have asked by then.
        await reg.watch("worker", discovery_tags("tiny", "e/pd"))
        assert reg.endpoints("worker") == ["127.0.0.1:21001"]
        await asyncio.sleep(0.2)
        assert not double.queries("prism-worker")
        await reg.close()
        assert not double.services

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_discovery_survives_the_agent_being_away():
    async def main() -> None:
        watcher = registry(double, token="wrong")
        await watcher.watch("worker")
        # Refused: the watcher backs off and keeps trying, without a tight loop (which would
        # ask again within milliseconds, where the watcher waits half a second at least).
        assert await until(lambda: len(double.queries("prism-worker")) >= 3)
        tries = [query.at for query in double.queries("prism-worker")]
        assert min(b - a for a, b in itertools.pairwise(tries)) >= 0.5
        assert watcher.endpoints("worker") == []
        await watcher.close()

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())


def test_the_token_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CONSUL_HTTP_TOKEN", TOKEN)

    async def main() -> None:
        reg = registry(double, token=None)
        await reg.register(Instance("encoder", "127.0.0.1:50052", "tiny", ("e/pd",)))
        assert double.requests[-1].headers["x-consul-token"] == TOKEN
        await reg.close()

    with ConsulDouble(token=TOKEN) as double:
        asyncio.run(main())
