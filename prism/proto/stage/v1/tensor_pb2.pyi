from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_TYPE_UNSPECIFIED: _ClassVar[MemoryType]
    MEMORY_TYPE_DRAM: _ClassVar[MemoryType]
    MEMORY_TYPE_VRAM: _ClassVar[MemoryType]
MEMORY_TYPE_UNSPECIFIED: MemoryType
MEMORY_TYPE_DRAM: MemoryType
MEMORY_TYPE_VRAM: MemoryType

class MemoryRegion(_message.Message):
    __slots__ = ("address", "length", "device_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    address: int
    length: int
    device_id: int
    def __init__(self, address: _Optional[int] = ..., length: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class TensorDescriptor(_message.Message):
    __slots__ = ("dtype", "shape", "nixl", "inline_data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    INLINE_DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nixl: NixlLocation
    inline_data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nixl: _Optional[_Union[NixlLocation, _Mapping]] = ..., inline_data: _Optional[bytes] = ...) -> None: ...

class NixlLocation(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "memory_type", "regions", "notification_tag", "lease_expiry_unix_ms")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_TAG_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    memory_type: MemoryType
    regions: _containers.RepeatedCompositeFieldContainer[MemoryRegion]
    notification_tag: str
    lease_expiry_unix_ms: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., memory_type: _Optional[_Union[MemoryType, str]] = ..., regions: _Optional[_Iterable[_Union[MemoryRegion, _Mapping]]] = ..., notification_tag: _Optional[str] = ..., lease_expiry_unix_ms: _Optional[int] = ...) -> None: ...
