"""Creating a message, whatever the door: the request checked and made the processor's
chat call, its replies made the message or its stream events. The REST router and the gRPC
service (prism.v1.MessagesService) both serve it, so that they answer alike."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from prism import telemetry
from prism.gateway import bodies
from prism.gateway.anthropic.answer import Event, MessageAnswer, MessageEvents
from prism.gateway.anthropic.convert import chat_body
from prism.gateway.anthropic.schemas import MessagesRequest
from prism.gateway.client import ReplyStream
from prism.gateway.openai.chat import chat_request
from prism.gateway.streaming import open_stream, read_all
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import PrismError

Chat = Callable[[inference_pb2.ChatRequest], ReplyStream]


class OpenedMessage:
    """A message under way: read it with `whole` or, if `stream`, with `events`."""

    def __init__(
        self,
        stream: bool,
        answer: MessageAnswer,
        call: ReplyStream,
        first: Any,
        rest: AsyncIterator,
        timer: telemetry.RequestTimer,
    ) -> None:
        self.stream = stream
        self.answer = answer
        self._call = call
        self._first = first
        self._rest = rest
        self._timer = timer

    async def whole(self) -> dict[str, Any]:
        """The message, once the answer is done."""
        try:
            replies = await read_all(self._first, self._rest, self._timer)
        finally:
            self._call.cancel()
        return self.answer.whole(replies)

    async def events(self) -> AsyncIterator[list[Event]]:
        """The stream's events, those of each reply together. A failure after the first
        reply raises PrismError: the door says it as it can (an error event, a status)."""
        events = MessageEvents(self.answer)
        completed = False
        try:
            yield events.opening(self._first) + events.event(self._first)
            last = self._first
            async for reply in self._rest:
                self._timer.reply(reply)
                last = reply
                yield events.event(reply)
            completed = True
            yield events.closing(last)
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            # A caller that goes lands here: cancelling aborts the whole chain.
            self._call.cancel()
            self._timer.finish(completed)


async def open_message(chat: Chat, body: Any, path: str) -> OpenedMessage:
    """Starts the message that `body` (a MessagesRequest, or its JSON object) asks for,
    once its first reply is in: a bad request raises PrismError and leaves nothing running.
    `path` names the call in the request metrics."""
    request = bodies.typed(body, MessagesRequest)
    answer = MessageAnswer()
    call = chat(chat_request(chat_body(request), answer.id))
    first, rest, timer = await open_stream(call, path)
    return OpenedMessage(bool(request.stream), answer, call, first, rest, timer)
