"""Starting a stage's gRPC server: health checking (NOT_SERVING until the stage says
otherwise), reflection, `LoadService`, and the bound on requests in flight."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from prism.proto.stage.v1 import load_pb2, load_pb2_grpc
from prism.proto.v1 import errors_pb2
from prism.rpc import options
from prism.rpc.errors import PrismError
from prism.rpc.ports import ensure_free, split
from prism.rpc.tls import server_credentials


class InFlightLimit:
    """A stage's bound on requests in flight: past it, RESOURCE_EXHAUSTED at once (the
    gateway answers 429 with Retry-After) rather than an unbounded queue."""

    RETRY_AFTER_S = 1

    def __init__(self, limit: int, what: str = "requests"):
        self.limit = limit
        self.what = what
        self.count = 0
        # When the last request was admitted (time.monotonic): what yields to them (batch
        # work) tells a quiet spell from a gap between requests.
        self.admitted_at = -math.inf

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.limit and self.count >= self.limit:
            raise PrismError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"overloaded: {self.count} {self.what} in flight, the limit is {self.limit}; "
                "retry later",
                reason=errors_pb2.ERROR_REASON_OVERLOADED,
                metadata={"retry_after_s": str(self.RETRY_AFTER_S)},
            )
        self.count += 1
        self.admitted_at = time.monotonic()
        try:
            yield
        finally:
            self.count -= 1


@dataclass
class Server:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    draining: bool = False
    # grpc.health.v1 alone, in plaintext (`start_server`'s `health_address`).
    health_server: grpc.aio.Server | None = None
    # A warm spare: it reports SERVING only once promoted.
    standby: bool = False
    _held: list[str] | None = None

    async def stop(self, grace: float | None) -> None:
        if self.health_server is not None:
            await self.health_server.stop(grace)
        await self.server.stop(grace)

    async def set_serving(self, services: Iterable[str], serving: bool = True) -> None:
        if serving and self.draining:
            return  # a server shutting down never reports SERVING again
        if self.standby:
            self._held = list(services) if serving else None
            if serving:
                return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *services]:
            await self.health.set(name, status)

    async def promote(self) -> None:
        """A warm spare starts serving: SERVING, if it was ready."""
        self.standby = False
        if self._held is not None:
            await self.set_serving(self._held)


class LoadServicer(load_pb2_grpc.LoadServiceServicer):
    def __init__(self, in_flight: Callable[[], int]):
        self._in_flight = in_flight

    async def GetLoad(
        self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> load_pb2.GetLoadResponse:
        return load_pb2.GetLoadResponse(in_flight=self._in_flight())


LOAD_SERVICE = load_pb2.DESCRIPTOR.services_by_name["LoadService"].full_name


def _server_options(reuse_port: bool) -> list[tuple[str, int]]:
    # gRPC sets SO_REUSEPORT unless told not to, which would share a taken port quietly.
    return [*options.SERVER_OPTIONS, ("grpc.so_reuseport", int(reuse_port))]


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    in_flight: Callable[[], int] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_address: str = "",
    door: str = "gRPC",
    reuse_port: bool = False,
) -> Server:
    """Starts a gRPC server with health checking, reflection and raised message limits,
    and with `LoadService` when given a count of the requests in flight. With
    `health_address`, the same health is also served there alone, in plaintext: kubelet's
    gRPC probes and Consul's checks cannot present a client certificate to a server that
    requires one. A port another process listens on is refused (PortInUse, naming it as
    `door`), unless `reuse_port`: then it is shared with those that ask the same.

    Health reports NOT_SERVING until the caller says otherwise with `set_serving`.
    """
    if not reuse_port:
        ensure_free(door, *split(address))
    if health_address:
        ensure_free(f"{door} health", *split(health_address))
    server = grpc.aio.server(interceptors=interceptors, options=_server_options(reuse_port))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    extra = []
    if in_flight is not None:
        load_pb2_grpc.add_LoadServiceServicer_to_server(LoadServicer(in_flight), server)
        extra.append(LOAD_SERVICE)
    reflection.enable_server_reflection(
        [
            *names,
            *extra,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    credentials = server_credentials()
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    result = Server(server, health_servicer, port)
    if health_address:
        result.health_server = grpc.aio.server(options=_server_options(reuse_port=False))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, result.health_server)
        try:
            bound = result.health_server.add_insecure_port(health_address)
        except RuntimeError:
            bound = 0
        if bound == 0:
            await server.stop(None)
            raise OSError(f"cannot bind gRPC health server to {health_address}")
        await result.health_server.start()
    await result.set_serving(names, serving=False)
    return result
