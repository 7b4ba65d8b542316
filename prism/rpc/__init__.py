"""gRPC plumbing shared by every process: servers, channels and the error model. The
stage runtime builds on it: `prism.runtime.service` (one handler per RPC, every per-call
concern) and `prism.runtime.stage` (start-up and drain).

Errors travel as gRPC status codes with a `google.rpc.ErrorInfo` detail (a reason of
`prism.v1.ErrorReason` and the offending parameter), so any client can read them and the
gateway maps them to HTTP in one place (`http_status`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from prism import logs, tracing
from prism.stage.v1 import load_pb2, load_pb2_grpc
from prism.v1 import errors_pb2

log = logging.getLogger(__name__)

# Images travel inside requests to the processor and worker: raise gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ERROR_DOMAIN = "prism.v1"

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A peer cut off by the network sends nothing, not even a reset: a stream to it would
    # wait forever. A ping unanswered 5 s after it went out, every 10 s, ends the
    # connection (UNAVAILABLE), and its requests move to another replica. gRPC core
    # answers pings, not the busy event loop.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's default backoff grows to minutes: a replica that came up (or back) after a
    # peer's first try would stay unreachable from that peer for as long. (Not
    # grpc.min_reconnect_backoff_ms: it is also the connect timeout, 20 s by default.)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Servers accept the keepalive pings their clients send. By default a server takes a ping
# more often than every 5 minutes on an idle connection as abuse and, at the third, drops
# the connection with GOAWAY "too_many_pings": every idle channel was cut every 90 s.
# Half the clients' interval, so that a ping sent a little early is no abuse either.
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.http2.min_ping_interval_without_data_ms", 5_000)]

# One place for the gRPC -> HTTP mapping the gateway uses.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# Reasons whose HTTP status is finer than their gRPC code.
_HTTP_STATUS_BY_REASON = {errors_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE: 415}
_REASON_PREFIX = "ERROR_REASON_"


@dataclass
class PrismError(Exception):
    """A request failure with its gRPC code, a reason and the parameter at fault. Without
    a finer reason, the reason is the one that names the code."""

    code: grpc.StatusCode
    message: str
    reason: errors_pb2.ErrorReason = errors_pb2.ERROR_REASON_UNSPECIFIED
    param: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.reason == errors_pb2.ERROR_REASON_UNSPECIFIED:
            self.reason = errors_pb2.ErrorReason.Value(_REASON_PREFIX + self.code.name)

    def __str__(self) -> str:
        return self.message

    @property
    def reason_name(self) -> str:
        """The reason as `ErrorInfo` carries it: "KV_TRANSFER_FAILED"."""
        return errors_pb2.ErrorReason.Name(self.reason).removeprefix(_REASON_PREFIX)

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS_BY_REASON.get(self.reason) or _HTTP_STATUS.get(self.code, 500)

    def to_status(self) -> grpc.Status:
        info = error_details_pb2.ErrorInfo(
            reason=self.reason_name, domain=ERROR_DOMAIN, metadata=self.metadata
        )
        if self.param is not None:
            info.metadata["param"] = self.param
        detail = status_pb2.Status().details.add()
        detail.Pack(info)
        status = status_pb2.Status(
            code=getattr(code_pb2, self.code.name), message=self.message, details=[detail]
        )
        return rpc_status.to_status(status)

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> PrismError:
        """Reads the code, message and ErrorInfo back from a failed call."""
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        message = err.details() if callable(getattr(err, "details", None)) else str(err)
        reason, param, metadata = errors_pb2.ERROR_REASON_UNSPECIFIED, None, {}
        status = rpc_status.from_call(err) if hasattr(err, "trailing_metadata") else None
        for detail in status.details if status else ():
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                # A reason this version does not know (a newer peer's) leaves the code's.
                name = _REASON_PREFIX + info.reason
                if name in errors_pb2.ErrorReason.DESCRIPTOR.values_by_name:
                    reason = errors_pb2.ErrorReason.Value(name)
                metadata = dict(info.metadata)
                param = metadata.pop("param", None)
        return cls(code, message or code.name, reason=reason, param=param, metadata=metadata)


class InFlightLimit:
    """A stage's bound on requests in flight: past it, RESOURCE_EXHAUSTED at once (the
    gateway answers 429 with Retry-After) rather than an unbounded queue."""

    RETRY_AFTER_S = 1

    def __init__(self, limit: int, what: str = "requests"):
        self.limit = limit
        self.what = what
        self.count = 0

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
        try:
            yield
        finally:
            self.count -= 1


def invalid(
    message: str,
    param: str | None = None,
    reason: errors_pb2.ErrorReason = errors_pb2.ERROR_REASON_UNSPECIFIED,
) -> PrismError:
    return PrismError(grpc.StatusCode.INVALID_ARGUMENT, message, reason=reason, param=param)


def unsupported_media(message: str, param: str) -> PrismError:
    return invalid(message, param, errors_pb2.ERROR_REASON_UNSUPPORTED_MEDIA_TYPE)


def check_size(data: bytes, what: str, limit: int, param: str) -> None:
    """Refuses media bytes that are empty or over `limit`."""
    if not data:
        raise invalid(f"{what} is empty", param)
    if len(data) > limit:
        raise invalid(f"{what} is {len(data)} bytes, more than the limit of {limit}", param)


def status_for(exc: BaseException, where: str = "") -> PrismError:
    """The status a call ends with when its handler raised `exc`; an error nobody
    foresaw names `where` it happened (the stage)."""
    if isinstance(exc, PrismError):
        return exc
    if isinstance(exc, grpc.RpcError):
        return PrismError.from_rpc_error(exc)
    log.exception("unhandled error in RPC", exc_info=exc)
    place = f" in the {where}" if where else ""
    return PrismError(
        grpc.StatusCode.INTERNAL, f"internal error{place}: {type(exc).__name__}: {exc}"
    )


def call_metadata() -> tuple[tuple[str, str], ...]:
    """Metadata for a call made on behalf of the current request: its request id."""
    request_id = logs.REQUEST_ID.get()
    return ((logs.HEADER, request_id),) if request_id else ()


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


def _channel_options() -> list[tuple[str, object]]:
    if _tls is not None and _tls.server_name:
        return [*_OPTIONS, ("grpc.ssl_target_name_override", _tls.server_name)]
    return _OPTIONS


def _channel_credentials() -> grpc.ChannelCredentials:
    assert _tls is not None
    return grpc.ssl_channel_credentials(_tls.ca, _tls.key, _tls.cert)


@dataclass
class Server:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    draining: bool = False
    # grpc.health.v1 alone, in plaintext (`start_server`'s `health_address`).
    health_server: grpc.aio.Server | None = None

    async def stop(self, grace: float | None) -> None:
        if self.health_server is not None:
            await self.health_server.stop(grace)
        await self.server.stop(grace)

    async def set_serving(self, services: Iterable[str], serving: bool = True) -> None:
        if serving and self.draining:
            return  # a server shutting down never reports SERVING again
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *services]:
            await self.health.set(name, status)


class LoadServicer(load_pb2_grpc.LoadServiceServicer):
    def __init__(self, in_flight: Callable[[], int]):
        self._in_flight = in_flight

    async def GetLoad(
        self, request: load_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> load_pb2.GetLoadResponse:
        return load_pb2.GetLoadResponse(in_flight=self._in_flight())


LOAD_SERVICE = load_pb2.DESCRIPTOR.services_by_name["LoadService"].full_name


async def start_server(
    address: str,
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    in_flight: Callable[[], int] | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_address: str = "",
) -> Server:
    """Starts a gRPC server with health checking, reflection and raised message limits,
    and with `LoadService` when given a count of the requests in flight. With
    `health_address`, the same health is also served there alone, in plaintext: kubelet's
    gRPC probes and Consul's checks cannot present a client certificate to a server that
    requires one.

    Health reports NOT_SERVING until the caller says otherwise with `set_serving`.
    """
    server = grpc.aio.server(interceptors=interceptors, options=_SERVER_OPTIONS)
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
    if _tls is None:
        port = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials(
            [(_tls.key, _tls.cert)], root_certificates=_tls.ca, require_client_auth=bool(_tls.ca)
        )
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"cannot bind gRPC server to {address}")
    await server.start()
    result = Server(server, health_servicer, port)
    if health_address:
        result.health_server = grpc.aio.server(options=_SERVER_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, result.health_server)
        if result.health_server.add_insecure_port(health_address) == 0:
            await server.stop(None)
            raise OSError(f"cannot bind gRPC health server to {health_address}")
        await result.health_server.start()
    await result.set_serving(names, serving=False)
    return result


def channel(address: str) -> grpc.aio.Channel:
    interceptors = tracing.client_interceptors()
    if _tls is None:
        return grpc.aio.insecure_channel(address, _OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, _channel_credentials(), _channel_options(), interceptors=interceptors
    )


def sync_channel(address: str) -> grpc.Channel:
    if _tls is None:
        return grpc.insecure_channel(address, options=_OPTIONS)
    return grpc.secure_channel(address, _channel_credentials(), _channel_options())


async def is_serving(channel: grpc.aio.Channel, service: str = "", timeout: float = 1.0) -> bool:
    """True when the server behind `channel` reports SERVING."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def check_health(address: str, service: str = "", timeout: float = 1.0) -> bool:
    """True when the server at `address` reports SERVING (blocking; for launchers and tests)."""
    with sync_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
