"""The OpenAI REST API (and KServe) as a door of a stage that serves gRPC too: uvicorn
in the stage's own event loop, opened and closed by the stage runtime
(prism.runtime.stage), calling the processor in the same process."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from prism.gateway import app as gateway
from prism.gateway.client import InProcessClient
from prism.rpc.ports import PortInUse, ensure_free

if TYPE_CHECKING:
    from prism.config.commands import FrontStageConfig
    from prism.gateway.openai.responses.store import ResponseStore
    from prism.rpc.server import Server

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The stage owns SIGINT and SIGTERM: it drains, then closes this door.
        yield


class HttpDoor:
    """The front's HTTP door, calling the InferenceService whose RPC handlers are
    `handlers` (`Service.handlers`) in this process; its Responses API keeps `stored`
    (if given, else a store of the flags')."""

    def __init__(
        self, config: FrontStageConfig, handlers: Any, stored: ResponseStore | None = None
    ) -> None:
        self.config = config
        self.handlers = handlers
        self.stored = stored
        self._server: _Server | None = None
        self._closed = False

    async def serve(self, server: Server) -> None:
        config = self.config
        host = config.http.http_host or config.address.host
        port, grace = config.http.http_port, config.address.shutdown_grace_s
        processor = InProcessClient(self.handlers, server.health, config.gateway.request_timeout)
        app = gateway.build(config, host, port, grace, processor=processor, stored=self.stored)
        settings = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            # uvicorn's lines through the process's own handler (and format: JSON too).
            log_config=None,
            access_log=False,
            timeout_keep_alive=config.gateway.http_keep_alive_s,
            timeout_graceful_shutdown=grace,
        )
        self._server = _Server(settings)
        self._server.should_exit = self._closed
        # Bound here rather than by uvicorn, which can neither share a port nor say why
        # it could not bind one but by exiting.
        sockets = _bind(host, port, self.config.address.reuse_port)
        log.info("OpenAI REST API on http://%s:%d", host, port)
        try:
            await self._server.serve(sockets)
        except SystemExit:
            # uvicorn's way to say it could not start (its port taken, its lifespan failed).
            raise OSError(f"cannot serve HTTP on {host}:{port}") from None

    def close(self) -> None:
        """Takes no new connections; those open get the grace period to finish."""
        self._closed = True
        if self._server is not None:
            self._server.should_exit = True


def ensure_doors_free(config: FrontStageConfig) -> None:
    """Refuses (PortInUse) a front's HTTP or KServe port where another process listens,
    but where the fronts share them on purpose (--reuse-port): checked before the front
    starts anything."""
    if not config.address.reuse_port:
        host = config.http.http_host or config.address.host
        ensure_free("HTTP", host, config.http.http_port)
        ensure_free("KServe gRPC", host, config.gateway.kserve_grpc_port)


def _bind(host: str, port: int, reuse_port: bool) -> list[socket.socket]:
    """Listening sockets at every address `host` names, as asyncio's create_server binds
    them; with `reuse_port`, shared with other processes that ask the same."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse("HTTP", host, port) from None
        raise OSError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
    return sockets
