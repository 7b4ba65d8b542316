from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_UNSUPPORTED_MEDIA_TYPE: _ClassVar[ErrorReason]
    ERROR_REASON_URL_REFUSED: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_API_KEY: _ClassVar[ErrorReason]
    ERROR_REASON_OVERLOADED: _ClassVar[ErrorReason]
    ERROR_REASON_EMBEDDINGS_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_KV_TRANSFER_FAILED: _ClassVar[ErrorReason]
    ERROR_REASON_CANCELLED: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN: _ClassVar[ErrorReason]
    ERROR_REASON_INVALID_ARGUMENT: _ClassVar[ErrorReason]
    ERROR_REASON_DEADLINE_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_ALREADY_EXISTS: _ClassVar[ErrorReason]
    ERROR_REASON_PERMISSION_DENIED: _ClassVar[ErrorReason]
    ERROR_REASON_RESOURCE_EXHAUSTED: _ClassVar[ErrorReason]
    ERROR_REASON_FAILED_PRECONDITION: _ClassVar[ErrorReason]
    ERROR_REASON_ABORTED: _ClassVar[ErrorReason]
    ERROR_REASON_OUT_OF_RANGE: _ClassVar[ErrorReason]
    ERROR_REASON_UNIMPLEMENTED: _ClassVar[ErrorReason]
    ERROR_REASON_INTERNAL: _ClassVar[ErrorReason]
    ERROR_REASON_UNAVAILABLE: _ClassVar[ErrorReason]
    ERROR_REASON_DATA_LOSS: _ClassVar[ErrorReason]
    ERROR_REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_UNSUPPORTED_MEDIA_TYPE: ErrorReason
ERROR_REASON_URL_REFUSED: ErrorReason
ERROR_REASON_MODEL_NOT_FOUND: ErrorReason
ERROR_REASON_INVALID_API_KEY: ErrorReason
ERROR_REASON_OVERLOADED: ErrorReason
ERROR_REASON_EMBEDDINGS_UNAVAILABLE: ErrorReason
ERROR_REASON_KV_TRANSFER_FAILED: ErrorReason
ERROR_REASON_CANCELLED: ErrorReason
ERROR_REASON_UNKNOWN: ErrorReason
ERROR_REASON_INVALID_ARGUMENT: ErrorReason
ERROR_REASON_DEADLINE_EXCEEDED: ErrorReason
ERROR_REASON_NOT_FOUND: ErrorReason
ERROR_REASON_ALREADY_EXISTS: ErrorReason
ERROR_REASON_PERMISSION_DENIED: ErrorReason
ERROR_REASON_RESOURCE_EXHAUSTED: ErrorReason
ERROR_REASON_FAILED_PRECONDITION: ErrorReason
ERROR_REASON_ABORTED: ErrorReason
ERROR_REASON_OUT_OF_RANGE: ErrorReason
ERROR_REASON_UNIMPLEMENTED: ErrorReason
ERROR_REASON_INTERNAL: ErrorReason
ERROR_REASON_UNAVAILABLE: ErrorReason
ERROR_REASON_DATA_LOSS: ErrorReason
ERROR_REASON_UNAUTHENTICATED: ErrorReason
