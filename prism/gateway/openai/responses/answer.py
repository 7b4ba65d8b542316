"""A response as vLLM's server writes it, from the processor's chat messages: the response
object, whole, and the typed events of a streamed one (`response.created`, each output
item opened, its deltas, its close, `response.completed`), as its simple (non-Harmony)
path emits them: reasoning, then content, then each tool call, each an output item."""

from __future__ import annotations

import time
import uuid
from typing import Any

from prism.gateway.openai.chat import chat_logprobs
from prism.gateway.openai.protocol import logprob, position_tokens
from prism.proto.v1 import common_pb2, inference_pb2


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(value: common_pb2.Usage) -> dict[str, Any]:
    return {
        "input_tokens": value.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": value.cached_tokens,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": value.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": value.reasoning_tokens,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": value.total_tokens,
    }


def _text_part(text: str, logprobs: list | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message(item_id: str, parts: list, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "content": parts,
            "status": status, "phase": None}  # fmt: skip


def _reasoning(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    item = {"id": item_id, "type": "reasoning", "summary": [], "status": status}
    if text is not None:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


class ResponseAnswer:
    """One Responses request's answer: `whole` from all the choice's messages, or `event`
    per message then `close` for a stream. `request` is the body as sent."""

    def __init__(self, response_id: str, request: dict[str, Any], top_logprobs: int | None):
        self.id = response_id
        self.request = request
        self.created = int(time.time())
        # Top logprobs per position, where the client included them.
        self.top_logprobs = top_logprobs
        # The stream's state: its output items so far, the one open and its text.
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._logprobs: list = []
        self._call_index: int | None = None
        self._sequence = 0

    def response(
        self, model: str, status: str, output: list, used: common_pb2.Usage | None
    ) -> dict[str, Any]:
        """The response object, as `vllm serve` fills it from the request."""
        body = self.request
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "model": model,
            "object": "response",
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0),
            # As vLLM's server: no tools, no choice.
            "tool_choice": body.get("tool_choice", "auto") if body.get("tools") else "none",
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "background": False,
            "max_output_tokens": body.get("max_output_tokens"),
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "status": status,
            "text": body.get("text"),
            "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation", "disabled"),
            "usage": None if used is None else usage(used),
            "user": body.get("user"),
            "presence_penalty": body.get("presence_penalty", 0.0),
            "frequency_penalty": body.get("frequency_penalty", 0.0),
        }

    def _whole_logprobs(self, replies: list) -> list | None:
        if self.top_logprobs is None:
            return None
        positions = [p for reply in replies for p in reply.logprobs]
        return chat_logprobs(positions, self.top_logprobs)["content"]

    def whole(self, replies: list[inference_pb2.ChatResponse]) -> dict[str, Any]:
        end = replies[-1]
        output: list[dict[str, Any]] = []
        if end.HasField("parsed"):
            parsed = end.parsed
            if parsed.reasoning:
                # Without a status, as vLLM's whole answer writes it (its stream's is
                # "completed").
                output.append(_reasoning(_id("rs"), parsed.reasoning, None))
            content = parsed.content if parsed.HasField("content") else ""
            calls = list(parsed.tool_calls)
            reason = parsed.finish_reason
        else:
            content, calls, reason = "".join(r.text for r in replies), [], end.finish_reason
        if content or not calls:
            parts = [_text_part(content, self._whole_logprobs(replies))] if content else []
            output.append(_message(_id("msg"), parts, "completed"))
        for call in calls:
            output.append(_call(_id("fc"), call.id, call.name, call.arguments, "completed"))
        return self.response(end.model, _status(reason), output, end.usage)

    # The stream.

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self, model: str) -> list[dict[str, Any]]:
        started = self.response(model, "in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]  # fmt: skip

    def event(self, reply: inference_pb2.ChatResponse) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reply.reasoning:
            events += self._switch("reasoning")
            events += self._delta("response.reasoning_text.delta", reply.reasoning)
        if reply.text:
            events += self._switch("message")
            logprobs = self._stream_logprobs(list(reply.logprobs))
            events += self._delta("response.output_text.delta", reply.text, logprobs=logprobs)
        for call in reply.tool_calls:
            if call.name and (self._call_index != call.index or self._kind() != "function_call"):
                events += self._close()
                events += self._open_item(_call(_id("fc"), call.id, call.name, "", "in_progress"))
                self._call_index = call.index
            if call.arguments:
                self._text += call.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          **self._where(), delta=call.arguments))  # fmt: skip
        return events

    def closing(self, last: inference_pb2.ChatResponse) -> list[dict[str, Any]]:
        events = self._close()
        status = _status(last.parsed.finish_reason if last.HasField("parsed")
                         else last.finish_reason)  # fmt: skip
        final = self.response(last.model, status, self.output, last.usage)
        return [*events, self._event("response.completed", response=final)]

    def failure(self, error: dict[str, Any]) -> dict[str, Any]:
        """The event that ends a stream that failed (an OpenAI error body's fields)."""
        return self._event("error", code=error["code"], message=error["message"],
                           param=error["param"])  # fmt: skip

    def _kind(self) -> str | None:
        return self._open["type"] if self._open else None

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"output_index": len(self.output), "item_id": self._open["id"]}

    def _switch(self, kind: str) -> list[dict[str, Any]]:
        if self._kind() == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            item, part = (
                _reasoning(_id("rs"), None, "in_progress"),
                {"text": "", "type": "reasoning_text"},
            )
        else:
            item, part = _message(_id("msg"), [], "in_progress"), _text_part("", [])
        events += self._open_item(item)
        events.append(self._event("response.content_part.added", **self._where(),
                                  content_index=0, part=part))  # fmt: skip
        return events

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open, self._text, self._logprobs = item, "", []
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=dict(item))]  # fmt: skip

    def _delta(self, kind: str, text: str, **extra: Any) -> list[dict[str, Any]]:
        self._text += text
        return [self._event(kind, **self._where(), content_index=0, delta=text, **extra)]

    def _stream_logprobs(self, positions: list) -> list:
        if self.top_logprobs is None:
            return []
        self._logprobs += self._whole_positions(positions)
        return [
            {"token": p.token.token, "logprob": logprob(p.token.logprob),
             "top_logprobs": [{"token": t.token, "logprob": logprob(t.logprob)}
                              for t in position_tokens(p)[: self.top_logprobs]]}
            for p in positions
        ]  # fmt: skip

    def _whole_positions(self, positions: list) -> list:
        return chat_logprobs(positions, self.top_logprobs or 0)["content"]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        where, text = self._where(), self._text
        if item["type"] == "message":
            part = _text_part(text, self._logprobs or None)
            done = _message(item["id"], [part] if text else [], "completed")
            events = [
                self._event("response.output_text.done", **where, content_index=0, text=text,
                            logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]  # fmt: skip
        elif item["type"] == "reasoning":
            done = _reasoning(item["id"], text, "completed")
            events = [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text),
                self._event("response.content_part.done", **where, content_index=0,
                            part=done["content"][0]),
            ]  # fmt: skip
        else:
            done = _call(item["id"], item["call_id"], item["name"], text, "completed")
            events = [self._event("response.function_call_arguments.done", **where,
                                  arguments=text, name=item["name"])]  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=done))  # fmt: skip
        self.output.append(done)
        self._open = None
        return events


def _status(reason: int) -> str:
    return "incomplete" if reason == common_pb2.FINISH_REASON_LENGTH else "completed"
