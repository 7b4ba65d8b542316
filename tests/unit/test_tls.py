"""TLS between services: certificates made by the test (a CA, then a certificate for
loopback signed by it), a real gRPC server and channels in this process."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress

import grpc
import pytest
from conftest import serving
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prism.proto.stage.v1 import load_pb2, load_pb2_grpc
from prism.rpc.channel import channel as open_channel
from prism.rpc.channel import check_health, is_serving
from prism.rpc.server import start_server
from prism.rpc.tls import Tls, configure_tls
from prism.runtime.ports import free_port


def certificate(name: str, issuer: tuple | None = None) -> tuple[bytes, bytes, tuple]:
    """(cert PEM, key PEM, signer): a CA when `issuer` is None, else a loopback leaf."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer or (subject, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is not None:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    cert = builder.sign(issuer_key, hashes.SHA256())
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )  # fmt: skip
    return pem, key_pem, (subject, key)


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
