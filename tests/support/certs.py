"""Certificates made by a test: a CA, and loopback certificates it signs."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


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


def write_certificates(directory: Path, ca_name: str) -> dict[str, str]:
    """A CA named `ca_name` and a loopback certificate it signed, written to `directory`:
    the paths as `--tls-cert`, `--tls-key` and `--tls-ca` take them."""
    ca, _, signer = certificate(ca_name)
    cert, key, _ = certificate("prism-stage", issuer=signer)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, pem in (("tls_cert", cert), ("tls_key", key), ("tls_ca", ca)):
        path = directory / f"{name}.pem"
        path.write_bytes(pem)
        paths[name] = str(path)
    return paths
