"""Creating a response, whatever the door: the request object checked and made the
processor's chat call, its replies made the response object or its stream events, and
the turn stored for `previous_response_id`. The REST router and the gRPC service both
serve it, so that they answer alike and share one store."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import msgspec

from prism import telemetry
from prism.gateway import bodies
from prism.gateway.client import ReplyStream
from prism.gateway.openai import schemas
from prism.gateway.openai.chat import chat_request
from prism.gateway.openai.responses import items
from prism.gateway.openai.responses.answer import ResponseAnswer
from prism.gateway.openai.responses.store import ResponseStore, Stored
from prism.gateway.streaming import open_stream, read_all
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import PrismError

Chat = Callable[[inference_pb2.ChatRequest], ReplyStream]


class Responder:
    """Responses from the processor's chat call `chat`, kept in `store`."""

    def __init__(self, store: ResponseStore, chat: Chat) -> None:
        self.store = store
        self.chat = chat

    async def open(self, body: Any, path: str) -> Opened:
        """Starts the response that the request object `body` asks for, once its first
        reply is in: a bad request raises PrismError and leaves nothing running. `path`
        names the call in the request metrics."""
        body = msgspec.to_builtins(bodies.typed(body, schemas.ResponsesRequest))
        previous = body.get("previous_response_id")
        before = self.store.get(previous, "previous_response_id").messages if previous else None
        talk = items.conversation(body, before)
        chat = items.chat_body(body, talk)
        # Read before the call starts: a bad value must not leave a generation running.
        stream = bool(body.get("stream"))
        keep = self.store if items.stored(body) else None
        response_id = f"resp_{uuid.uuid4().hex}"
        try:
            message = chat_request(chat, response_id)
        except PrismError as error:
            raise _as_sent(error, talk) from None
        top = message.sampling.logprobs if message.sampling.HasField("logprobs") else None
        call = self.chat(message)
        try:
            first, rest, timer = await open_stream(call, path)
        except PrismError as error:
            raise _as_sent(error, talk) from None
        return Opened(stream, ResponseAnswer(response_id, body, top), call, first, rest, timer,
                      _Turn(keep, talk))  # fmt: skip


class _Turn:
    """The conversation so far, stored with its answer unless `store` is None."""

    def __init__(self, store: ResponseStore | None, talk: items.Conversation) -> None:
        self.store = store
        self.talk = talk

    def keep(self, response: dict[str, Any]) -> None:
        if self.store is not None:
            self.store.put(Stored(response, _turn(self.talk, response)))

    def error(self, exc: grpc.aio.AioRpcError) -> PrismError:
        return _as_sent(PrismError.from_rpc_error(exc), self.talk)


class Opened:
    """A response under way: read it with `whole` or, if `stream`, with `events`."""

    def __init__(
        self,
        stream: bool,
        answer: ResponseAnswer,
        call: ReplyStream,
        first: Any,
        rest: AsyncIterator,
        timer: telemetry.RequestTimer,
        turn: _Turn,
    ) -> None:
        self.stream = stream
        self.answer = answer
        self._call = call
        self._first = first
        self._rest = rest
        self._timer = timer
        self._turn = turn

    async def whole(self) -> dict[str, Any]:
        """The response object, once the answer is done."""
        try:
            replies = await read_all(self._first, self._rest, self._timer)
        except PrismError as error:
            raise _as_sent(error, self._turn.talk) from None
        except BaseException:
            self._call.cancel()
            raise
        response = self.answer.whole(replies)
        self._turn.keep(response)
        return response

    async def events(self) -> AsyncIterator[list[dict[str, Any]]]:
        """The stream's events, those of each reply together. A failure after the first
        reply raises PrismError: the door says it as it can (an error event, a status)."""
        completed = False
        try:
            yield self.answer.opening(self._first.model) + self.answer.event(self._first)
            last = self._first
            async for reply in self._rest:
                self._timer.reply(reply)
                last = reply
                yield self.answer.event(reply)
            closing = self.answer.closing(last)
            self._turn.keep(closing[-1]["response"])
            completed = True
            yield closing
        except grpc.aio.AioRpcError as exc:
            raise self._turn.error(exc) from None
        finally:
            self._call.cancel()
            self._timer.finish(completed)


def _turn(talk: items.Conversation, response: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a follow-up continues: this turn's, then its answer's text (its
    reasoning and calls left out, as vLLM's server leaves them)."""
    said = [
        {"role": "assistant", "content": part["text"]}
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    ]
    return [*talk.messages, *said]


def _as_sent(error: PrismError, talk: items.Conversation) -> PrismError:
    """`error`, naming the field as a Responses request has it."""
    error = talk.error(error)
    if error.param == "max_tokens":
        error.message = error.message.replace("max_tokens", "max_output_tokens")
        error.param = "max_output_tokens"
    if error.param in ("response_format", "structured_output"):
        error.param = "text.format"
    return error
