"""TLS between services, set once per process at start-up: servers and channels read it
here, plaintext when none is configured."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from prism.rpc import options


@dataclass(frozen=True)
class Tls:
    """TLS between services: this process's certificate and key, and the CA that signed
    its peers' (given a CA, servers also require client certificates: mutual TLS)."""

    cert: bytes
    key: bytes
    ca: bytes | None = None
    # Name to check in the servers' certificates instead of the dialed host.
    server_name: str = ""

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str = "", server_name: str = "") -> Tls:
        def read(path: str) -> bytes:
            with open(path, "rb") as f:
                return f.read()

        return cls(read(cert), read(key), read(ca) if ca else None, server_name)


# Set once at start-up by `configure_tls`; plaintext when None.
_tls: Tls | None = None


def configure_tls(tls: Tls | None) -> None:
    global _tls
    _tls = tls


def tls_enabled() -> bool:
    return _tls is not None


def server_credentials() -> grpc.ServerCredentials | None:
    """None in plaintext."""
    if _tls is None:
        return None
    return grpc.ssl_server_credentials(
        [(_tls.key, _tls.cert)], root_certificates=_tls.ca, require_client_auth=bool(_tls.ca)
    )


def channel_credentials() -> grpc.ChannelCredentials | None:
    """None in plaintext."""
    if _tls is None:
        return None
    return grpc.ssl_channel_credentials(_tls.ca, _tls.key, _tls.cert)


def channel_options() -> list[tuple[str, object]]:
    if _tls is not None and _tls.server_name:
        return [*options.CHANNEL_OPTIONS, ("grpc.ssl_target_name_override", _tls.server_name)]
    return options.CHANNEL_OPTIONS
