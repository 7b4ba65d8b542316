from google.protobuf import struct_pb2 as _struct_pb2
from prism.proto.stage.v1 import encoder_pb2 as _encoder_pb2
from prism.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "files", "embeddings", "layouts", "kv_transfer_params", "adapter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    files: MediaFiles
    embeddings: _encoder_pb2.MediaEmbeddings
    layouts: MediaLayouts
    kv_transfer_params: KvTransferParams
    adapter: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., files: _Optional[_Union[MediaFiles, _Mapping]] = ..., embeddings: _Optional[_Union[_encoder_pb2.MediaEmbeddings, _Mapping]] = ..., layouts: _Optional[_Union[MediaLayouts, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class MediaFiles(_message.Message):
    __slots__ = ("images", "videos", "audios")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.Image]
    videos: _containers.RepeatedCompositeFieldContainer[_common_pb2.Video]
    audios: _containers.RepeatedCompositeFieldContainer[_common_pb2.Audio]
    def __init__(self, images: _Optional[_Iterable[_Union[_common_pb2.Image, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[_common_pb2.Video, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[_common_pb2.Audio, _Mapping]]] = ...) -> None: ...

class MediaLayouts(_message.Message):
    __slots__ = ("images", "videos", "audios")
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    AUDIOS_FIELD_NUMBER: _ClassVar[int]
    images: _containers.RepeatedCompositeFieldContainer[MediaLayout]
    videos: _containers.RepeatedCompositeFieldContainer[MediaLayout]
    audios: _containers.RepeatedCompositeFieldContainer[MediaLayout]
    def __init__(self, images: _Optional[_Iterable[_Union[MediaLayout, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[MediaLayout, _Mapping]]] = ..., audios: _Optional[_Iterable[_Union[MediaLayout, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "first", "last", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first: PromptUsage
    last: Finish
    logprobs: _containers.RepeatedCompositeFieldContainer[EngineLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., first: _Optional[_Union[PromptUsage, _Mapping]] = ..., last: _Optional[_Union[Finish, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[EngineLogprobs, _Mapping]]] = ...) -> None: ...

class EngineLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs", "rank")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class PromptUsage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "prompt_logprobs")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[EngineLogprobs]
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[EngineLogprobs, _Mapping]]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("reason", "kv_transfer_params", "layouts")
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    reason: _common_pb2.FinishReason
    kv_transfer_params: KvTransferParams
    layouts: MediaLayouts
    def __init__(self, reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_transfer_params: _Optional[_Union[KvTransferParams, _Mapping]] = ..., layouts: _Optional[_Union[MediaLayouts, _Mapping]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("call_id", "start", "cancel", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    start: GenerateRequest
    cancel: _common_pb2.CallCancel
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, call_id: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[_common_pb2.CallCancel, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[GenerateEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[GenerateEvent, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("call_id", "reply", "end")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    reply: GenerateResponse
    end: _common_pb2.CallStatus
    def __init__(self, call_id: _Optional[int] = ..., reply: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.CallStatus, _Mapping]] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens", "remote_prefill_cached_tokens", "remote_blocks_expiry_time", "transfer_mode", "remote_block_size", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _struct_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_struct_pb2.Value, _Mapping]] = ...) -> None: ...
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HOST_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PORT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DCP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_EXPIRY_TIME_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    do_remote_prefill: bool
    do_remote_decode: bool
    remote_block_ids: _containers.RepeatedCompositeFieldContainer[KvBlockIds]
    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    tp_size: int
    dcp_size: int
    pp_size: int
    remote_num_tokens: int
    remote_prefill_cached_tokens: int
    remote_blocks_expiry_time: float
    transfer_mode: str
    remote_block_size: int
    extra: _containers.MessageMap[str, _struct_pb2.Value]
    def __init__(self, do_remote_prefill: _Optional[bool] = ..., do_remote_decode: _Optional[bool] = ..., remote_block_ids: _Optional[_Iterable[_Union[KvBlockIds, _Mapping]]] = ..., remote_engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_host: _Optional[str] = ..., remote_port: _Optional[int] = ..., tp_size: _Optional[int] = ..., dcp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., remote_prefill_cached_tokens: _Optional[int] = ..., remote_blocks_expiry_time: _Optional[float] = ..., transfer_mode: _Optional[str] = ..., remote_block_size: _Optional[int] = ..., extra: _Optional[_Mapping[str, _struct_pb2.Value]] = ...) -> None: ...

class KvBlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MediaLayout(_message.Message):
    __slots__ = ("uuid", "num_tokens", "grid_thw", "second_per_grid_ts")
    UUID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    SECOND_PER_GRID_TS_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    num_tokens: int
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    second_per_grid_ts: float
    def __init__(self, uuid: _Optional[str] = ..., num_tokens: _Optional[int] = ..., grid_thw: _Optional[_Iterable[int]] = ..., second_per_grid_ts: _Optional[float] = ...) -> None: ...

class EngineServiceAbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class EngineServiceAbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class EngineServiceLoadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapter
    def __init__(self, adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class EngineServiceLoadAdapterResponse(_message.Message):
    __slots__ = ("max_loras",)
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    max_loras: int
    def __init__(self, max_loras: _Optional[int] = ...) -> None: ...

class EngineServiceUnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class EngineServiceUnloadAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...
