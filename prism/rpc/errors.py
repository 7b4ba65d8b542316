"""The error model: errors travel as gRPC status codes with a `google.rpc.ErrorInfo`
detail (a reason of `prism.v1.ErrorReason` and the offending parameter), so any client can
read them and the gateway maps them to HTTP in one place (`PrismError.http_status`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from prism.proto.v1 import errors_pb2

log = logging.getLogger(__name__)

ERROR_DOMAIN = "prism.v1"

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
