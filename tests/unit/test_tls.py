"""TLS between services: certificates made by the test (a CA, then a certificate for
loopback signed by it), a real gRPC server and channels in this process."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.certs import certificate
from support.serving import serving

from prism.proto.stage.v1 import load_pb2, load_pb2_grpc
from prism.rpc.channel import channel as open_channel
from prism.rpc.channel import check_health, is_serving
from prism.rpc.server import start_server
from prism.rpc.tls import Tls, configure_tls
from prism.runtime.ports import free_port


@pytest.fixture
def tls():
    ca, _, signer = certificate("prism-test-ca")
    cert, key, _ = certificate("prism-stage", issuer=signer)
    yield Tls(cert, key, ca)
    configure_tls(None)


def health_server() -> contextlib.AbstractContextManager[str]:
    """A gRPC server with health checking only."""
    return serving(lambda s: None, ["prism.test"])


def check(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=3
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_services_talk_mutual_tls(tls):
    configure_tls(tls)
    with health_server() as address:
        # A peer with a certificate from the CA gets in, sync and asyncio alike.
        assert check_health(address)

        async def over_aio() -> bool:
            async with open_channel(address) as channel:
                return await is_serving(channel)

        assert asyncio.run(over_aio())
        # Plaintext, or TLS without a client certificate, does not.
        assert not check(grpc.insecure_channel(address))
        anonymous = grpc.ssl_channel_credentials(root_certificates=tls.ca)
        assert not check(grpc.secure_channel(address, anonymous))


def test_server_name_override(tls):
    # The certificate names "localhost": dialed by another name it passes only with the
    # override, and a wrong override fails.
    configure_tls(Tls(tls.cert, tls.key, tls.ca, server_name="localhost"))
    with health_server() as address:
        assert check_health(address)
        configure_tls(Tls(tls.cert, tls.key, tls.ca, server_name="elsewhere.example"))
        assert not check_health(address)


def test_probes_reach_a_plaintext_health_port_and_nothing_else(tls):
    configure_tls(tls)
    port = free_port()

    async def main() -> None:
        server = await start_server(
            "127.0.0.1:0",
            lambda s: None,
            ["prism.test"],
            lambda: 0,
            health_address=f"127.0.0.1:{port}",
        )
        await server.set_serving(["prism.test"])
        probe = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        # As kubelet's gRPC probe and Consul's check: no certificate, yet an answer.
        assert await is_serving(probe, "prism.test")
        # The port serves health alone; the service port still wants a certificate.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await load_pb2_grpc.LoadServiceStub(probe).GetLoad(load_pb2.GetLoadRequest())
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        plain = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        assert not await is_serving(plain)
        await server.set_serving(["prism.test"], serving=False)
        assert not await is_serving(probe, "prism.test")
        await probe.close()
        await plain.close()
        await server.stop(None)

    asyncio.run(main())
