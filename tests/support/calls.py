"""Calls on a running mesh's gRPC services that the contract and end-to-end tests share."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from prism.rpc.channel import sync_channel


def inference(mesh) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(sync_channel(mesh.processor))


def greedy(max_tokens: int, **fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, **fields)


def text_message(text: str) -> inference_pb2.ChatMessage:
    return inference_pb2.ChatMessage(
        role=inference_pb2.ROLE_USER, content=[inference_pb2.ContentPart(text=text)]
    )


def finish_reason(reply) -> int:
    """How a stream ended, from its last message: a stage's or the public API's."""
    if isinstance(reply, engine_pb2.GenerateResponse):
        return reply.last.reason
    return reply.finish_reason


def abort_while_running(start: Callable[[], Iterator], abort: Callable[[], bool]) -> list:
    """Starts a long request, sends Abort until it lands, and returns the request's replies.

    The request registers a moment after its call starts, so the first Aborts may find
    nothing. A loaded machine can also stall the caller for seconds while the engine runs
    the request to its end; a request that ended before any Abort landed is started again."""
    for _ in range(3):
        call = start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if abort():
                return list(call)
            time.sleep(0.005)
        ended = list(call)
        assert finish_reason(ended[-1]) == common_pb2.FINISH_REASON_LENGTH, ended[-1]
    pytest.fail("no Abort landed in three requests that each ran to their end")
