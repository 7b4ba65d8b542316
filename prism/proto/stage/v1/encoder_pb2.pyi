from prism.proto.stage.v1 import tensor_pb2 as _tensor_pb2
from prism.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "videos", "audios")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    videos: _containers.RepeatedCompositeFieldContainer[_common_pb2.Video]
    audios: _containers.RepeatedCompositeFieldContainer[_common_pb2.Audio]
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[_common_pb2.Video, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[_common_pb2.Audio, _Mapping]]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: MediaEmbeddings
    def __init__(self, embeddings: _Optional[_Union[MediaEmbeddings, _Mapping]] = ...) -> None: ...

class MediaEmbeddings(_message.Message):
    __slots__ = ("images", "videos", "audios")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[EmbeddingHandle]
    videos: _containers.RepeatedCompositeFieldContainer[EmbeddingHandle]
    audios: _containers.RepeatedCompositeFieldContainer[EmbeddingHandle]
    def __init__(self, images: _Optional[_Iterable[_Union[EmbeddingHandle, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[EmbeddingHandle, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[EmbeddingHandle, _Mapping]]] = ...) -> None: ...

class EmbeddingHandle(_message.Message):
    __slots__ = ("embeddings", "content_hash", "grid_thw", "cached", "second_per_grid_ts")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_TS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _tensor_pb2.TensorDescriptor
    content_hash: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    cached: bool
    second_per_grid_ts: float
    def __init__(self, embeddings: _Optional[_Union[_tensor_pb2.TensorDescriptor, _Mapping]] = ..., content_hash: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., cached: _Optional[bool] = ..., second_per_grid_ts: _Optional[float] = ...) -> None: ...
