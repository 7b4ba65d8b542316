"""vLLM's KV transfer parameters as the typed `KvTransferParams` message, and back.

The NixlConnector hands prefill's parameters back as a dict; decode takes the same dict.
Every field vLLM has today is a typed field of the message; a field that a newer vLLM
adds travels in `extra` as a JSON value, so the decode engine still gets it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, struct_pb2

from prism.proto.stage.v1 import engine_pb2

log = logging.getLogger(__name__)

_BLOCK_IDS = "remote_block_ids"
_OPTIONAL = ("remote_blocks_expiry_time", "remote_block_size")
_FIELDS = {f.name for f in engine_pb2.KvTransferParams.DESCRIPTOR.fields} - {"extra"}
_SCALARS = sorted(_FIELDS - {_BLOCK_IDS, *_OPTIONAL})
_warned: set[str] = set()


def to_proto(params: Mapping[str, Any]) -> engine_pb2.KvTransferParams:
    message = engine_pb2.KvTransferParams()
    for key, value in params.items():
        if key == _BLOCK_IDS:
            message.remote_block_ids.extend(
                engine_pb2.KvBlockIds(ids=list(group)) for group in value
            )
        elif key in _FIELDS:
            if value is not None:
                setattr(message, key, value)
        else:
            if key not in _warned:
                _warned.add(key)
                log.warning("KV transfer parameter %r is not in prism.stage.v1; sent as JSON", key)
            message.extra[key].CopyFrom(json_format.ParseDict(value, struct_pb2.Value()))
    return message


def to_vllm(message: engine_pb2.KvTransferParams) -> dict[str, Any]:
    params: dict[str, Any] = {name: getattr(message, name) for name in _SCALARS}
    params[_BLOCK_IDS] = [list(group.ids) for group in message.remote_block_ids]
    for name in _OPTIONAL:
        # vLLM reads an absent optional field and a None one alike.
        params[name] = getattr(message, name) if message.HasField(name) else None
    for key, value in message.extra.items():
        params[key] = json_format.MessageToDict(value)
    return params
