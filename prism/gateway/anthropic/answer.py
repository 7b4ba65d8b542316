"""A Messages answer as vLLM's server writes it, from the processor's chat messages: the
message whole, or the events of a streamed one (`message_start`; each content block's
`content_block_start`, deltas and `content_block_stop`, in the order thinking, text, tool
calls; `message_delta` with the stop reason and usage; `message_stop`)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from prism.proto.v1 import common_pb2, inference_pb2

# A stream event: its name and its data.
Event = tuple[str, dict[str, Any]]


def usage(value: common_pb2.Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` leaves out what the prefix cache read."""
    counts = {"input_tokens": value.prompt_tokens - value.cached_tokens,
              "output_tokens": value.completion_tokens}  # fmt: skip
    if value.cached_tokens:
        counts["cache_read_input_tokens"] = value.cached_tokens
    return counts


def stop_reason(reply: inference_pb2.ChatResponse, tool_used: bool) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for the choice's last message."""
    if reply.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return "max_tokens", None
    if tool_used or reply.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS:
        return "tool_use", None
    if reply.stop_sequence:
        return "stop_sequence", reply.stop_sequence
    return "end_turn", None


def _tool_use(call: inference_pb2.ToolCall) -> dict[str, Any]:
    """A whole call as a `tool_use` block, as vLLM's server writes it: its arguments
    decoded (left out where they are JSON's null; arguments that are not JSON, which vLLM's
    server fails on, as no arguments)."""
    block: dict[str, Any] = {"type": "tool_use", "id": call.id, "name": call.name}
    try:
        value = json.loads(call.arguments or "{}")
    except json.JSONDecodeError:
        value = {}
    if value is not None:
        block["input"] = value
    return block


class MessageAnswer:
    """One Messages request's answer (its first choice)."""

    def __init__(self) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"

    def head(self, model: str) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": model}

    def whole(self, replies: list[inference_pb2.ChatResponse]) -> dict[str, Any]:
        last = replies[-1]
        content: list[dict[str, Any]] = []
        parsed = last.parsed if last.HasField("parsed") else None
        text = "".join(reply.text for reply in replies)
        if parsed is not None:
            text = parsed.content if parsed.HasField("content") else ""
            if parsed.HasField("reasoning") and parsed.reasoning:
                content.append({"type": "thinking", "thinking": parsed.reasoning,
                                "signature": uuid.uuid4().hex})  # fmt: skip
        if text:
            content.append({"type": "text", "text": text})
        calls = list(parsed.tool_calls) if parsed is not None else []
        content.extend(_tool_use(call) for call in calls)
        reason, sequence = stop_reason(last, bool(calls))
        return {
            **self.head(last.model),
            # Anthropic's empty answer is one empty text block.
            "content": content or [{"type": "text", "text": ""}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(last.usage),
        }


class MessageEvents:
    """A streamed answer's events, message by message: a content block is opened when a
    message brings a kind other than the open one's, and closed before the next opens."""

    def __init__(self, answer: MessageAnswer) -> None:
        self.answer = answer
        self.index = -1
        # The open block's kind: "thinking", "text" or a tool call's index in the choice.
        self.open: str | int | None = None
        self.tool_used = False

    def opening(self, first: inference_pb2.ChatResponse) -> list[Event]:
        message = {
            **self.answer.head(first.model),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage(first.usage), "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _start(self, kind: str | int, block: dict[str, Any]) -> list[Event]:
        events = self._stop()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, ("content_block_start", start)]

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        self.open = None
        events.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return ("content_block_delta",
                {"type": "content_block_delta", "index": self.index, "delta": delta})  # fmt: skip

    def event(self, reply: inference_pb2.ChatResponse) -> list[Event]:
        events: list[Event] = []
        if reply.reasoning:
            if self.open != "thinking":
                events += self._start("thinking", {"type": "thinking", "thinking": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": reply.reasoning}))
        if reply.text:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": reply.text}))
        for call in reply.tool_calls:
            if call.id and call.name:
                self.tool_used = True
                events += self._start(call.index, {"type": "tool_use", "id": call.id,
                                                   "name": call.name, "input": {}})  # fmt: skip
            if call.arguments and self.open == call.index:
                events.append(
                    self._delta({"type": "input_json_delta", "partial_json": call.arguments})
                )
        return events

    def closing(self, last: inference_pb2.ChatResponse) -> list[Event]:
        reason, sequence = stop_reason(last, self.tool_used)
        delta = {"type": "message_delta", "usage": usage(last.usage),
                 "delta": {"stop_reason": reason, "stop_sequence": sequence}}  # fmt: skip
        return [*self._stop(), ("message_delta", delta), ("message_stop", {"type": "message_stop"})]


def sse(events: list[Event]) -> bytes:
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
        for name, data in events
    )
