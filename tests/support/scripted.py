"""A processor that answers every chat call from a script, for the front's endpoints
tested alone (no process started)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from prism.gateway.client import LocalContext, _handle
from prism.proto.v1 import inference_pb2


class Call:
    """A chat call's replies, as the processor client's ReplyStream gives them."""

    def __init__(self, replies: list) -> None:
        self.replies = replies

    async def _each(self) -> AsyncIterator:
        for message in self.replies:
            yield message

    def __aiter__(self) -> AsyncIterator:
        return self._each()

    def ready(self) -> None:
        return None

    def cancel(self) -> bool:
        return True


class Scripted:
    """A processor that answers every chat with `replies`, and keeps the requests."""

    def __init__(self, replies: list) -> None:
        self.replies = replies
        self.requests: list[inference_pb2.ChatRequest] = []

    def chat(self, request: inference_pb2.ChatRequest) -> Call:
        self.requests.append(request)
        return Call(self.replies)

    async def count_tokens(
        self, request: inference_pb2.CountTokensRequest
    ) -> inference_pb2.CountTokensResponse:
        self.requests.append(request.chat)
        return inference_pb2.CountTokensResponse(input_tokens=42)

    async def close(self) -> None:
        pass


async def rpc(handler, request) -> list:
    """The replies of one call of a service's `handler` in this process, or the call's
    error raised."""
    replies: list = []
    result = await _handle(handler, request, LocalContext(replies.append))
    return replies if result is None else [result]
