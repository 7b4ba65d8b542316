"""Tools and reasoning in chat, as `vllm serve` does them: the request read by vLLM's own
request model (its checks, its tool schemas for the chat template, its structural tags
for forced calls), and each choice's output split into content, reasoning and tool calls
by vLLM's own parsers (--tool-call-parser, --reasoning-parser), streamed and whole."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
)
from vllm.exceptions import VLLMValidationError
from vllm.parser import Parser, ParserManager
from vllm.renderers.chat_utils import make_tool_call_id

from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import invalid

_MODES = {
    inference_pb2.TOOL_CHOICE_MODE_NONE: "none",
    inference_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    inference_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}
_STRUCTURED = {"json_schema": "json", "json_object": "json_object", "regex": "regex",
               "choice": "choice", "grammar": "grammar"}  # fmt: skip


@dataclass(frozen=True)
class Parsers:
    """The server's parsers: vLLM's composed parser class, None where neither is set."""

    parser_cls: type[Parser] | None = None
    enable_auto_tools: bool = False

    @classmethod
    def of(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        tool_call_parser: str = "",
        reasoning_parser: str = "",
        enable_auto_tools: bool = False,
    ) -> Parsers:
        """Raises ValueError for an unknown parser or one the tokenizer cannot serve."""
        if enable_auto_tools and not tool_call_parser:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        try:
            parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_call_parser or None,
                reasoning_parser_name=reasoning_parser or None,
                enable_auto_tools=enable_auto_tools,
                tokenizer=tokenizer,
            )
        except (KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"cannot use these parsers: {exc}") from None
        return cls(parser_cls, enable_auto_tools)

    @property
    def tools(self) -> bool:
        return self.parser_cls is not None and self.parser_cls.tool_parser_cls is not None

    @property
    def reasoning(self) -> bool:
        return self.parser_cls is not None and self.parser_cls.reasoning_parser_cls is not None


def _validated(body: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except VLLMValidationError as exc:
        raise _refusal(exc) from None


@functools.cache
def _plain_request() -> ChatCompletionRequest:
    return _validated({"messages": []})


def _openai_tool(tool: inference_pb2.Tool, index: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.HasField("description"):
        function["description"] = tool.description
    if tool.parameters:
        try:
            function["parameters"] = json.loads(tool.parameters)
        except json.JSONDecodeError as exc:
            raise invalid(f"tools[{index}] parameters are not JSON: {exc}", "tools") from None
    if tool.HasField("strict"):
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _tool_choice(choice: inference_pb2.ToolChoice) -> Any:
    kind = choice.WhichOneof("choice")
    if kind == "function":
        return {"type": "function", "function": {"name": choice.function}}
    if kind == "mode" and choice.mode in _MODES:
        return _MODES[choice.mode]
    return None


def _structured_outputs(wire: common_pb2.StructuredOutput) -> dict[str, Any] | None:
    kind = wire.WhichOneof("kind")
    if kind is None:
        return None
    value: Any = getattr(wire, kind)
    if kind == "json_schema":
        value = json.loads(value)
    elif kind == "choice":
        value = list(value.choices)
    return {_STRUCTURED.get(kind, kind): value}


def _refusal(exc: VLLMValidationError) -> Exception:
    return invalid(str(exc), exc.parameter or "tools")


def _validation_error(exc: ValidationError) -> Exception:
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, VLLMValidationError):
            return _refusal(cause)
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "tools"
    return invalid(f"{where}: {first['msg']}", str(first["loc"][0]) if first["loc"] else "tools")


@dataclass
class ChatParsing:
    """One chat request's tools and parsing: what its template renders, how it samples,
    and a parser per choice."""

    parsers: Parsers
    tokenizer: PreTrainedTokenizerBase
    # The request as vLLM's server reads it (what its parsers take).
    request: ChatCompletionRequest
    prompt_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        parsers: Parsers,
        tokenizer: PreTrainedTokenizerBase,
        chat: inference_pb2.ChatRequest,
    ) -> ChatParsing:
        body: dict[str, Any] = {"messages": []}
        if chat.tools:
            body["tools"] = [_openai_tool(tool, i) for i, tool in enumerate(chat.tools)]
        choice = _tool_choice(chat.tool_choice)
        if choice is not None:
            body["tool_choice"] = choice
        if chat.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = chat.parallel_tool_calls
        structured = _structured_outputs(chat.sampling.structured_output)
        if structured is not None:
            body["structured_outputs"] = structured
        # A chat with nothing for the parsers takes vLLM's model validated once (the
        # validation is most of this call's cost), copied: its parsers may set its fields.
        request = _plain_request().model_copy() if len(body) == 1 else _validated(body)
        parsing = cls(parsers, tokenizer, request)
        parsing._check_parser()
        return parsing

    def _check_parser(self) -> None:
        """As vLLM's server: tool choices other than none need the tool parser."""
        choice = self.request.tool_choice
        if self.parsers.tools or choice in (None, "none"):
            return
        if choice == "auto":
            message = '"auto" tool choice requires --enable-auto-tool-choice and ' \
                "--tool-call-parser to be set"  # fmt: skip
        else:
            named = isinstance(choice, ChatCompletionNamedToolChoiceParam)
            what = f'function "{choice.function.name}"' if named else f'"{choice}"'
            message = f"tool_choice={what} requires --tool-call-parser to be set"
        raise invalid(message, "tool_choice")

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (also with tool_choice none)."""
        if self.request.tools is None:
            return None
        return [tool.model_dump() for tool in self.request.tools]

    @property
    def active(self) -> bool:
        return self.parsers.parser_cls is not None

    def _parser(self) -> Parser:
        assert self.parsers.parser_cls is not None
        return self.parsers.parser_cls(self.tokenizer, self.request.tools,
                                       chat_template_kwargs={}, model_config=None)  # fmt: skip

    def adjust(self, sampling: common_pb2.SamplingParams) -> None:
        """What the parsers change in sampling, as vLLM's server applies it: a structural
        tag that holds forced calls to the tool parser's format, and special tokens kept
        in the text the parsers read."""
        parser_cls = self.parsers.parser_cls
        if parser_cls is None:
            return
        if parser_cls.reasoning_parser_cls is None and self.request.tool_choice == "none":
            return
        # In place, as vLLM's server adjusts the request its parsers then read.
        request = self._parser().adjust_request(self.request)
        tag = request.structured_outputs.structural_tag if request.structured_outputs else None
        if tag:
            sampling.structured_output.CopyFrom(common_pb2.StructuredOutput(structural_tag=tag))
        if not request.skip_special_tokens:
            sampling.skip_special_tokens = False

    def choice(self) -> ChoiceParsing:
        return ChoiceParsing(self, self._parser())


@dataclass
class Step:
    """What one delta of a choice's output adds, parsed."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[inference_pb2.ToolCallDelta] = field(default_factory=list)


class ChoiceParsing:
    """One choice's output through the parsers: each delta as vLLM's server streams it,
    and the whole output at the end as its answers that are not streamed hold it."""

    def __init__(self, parsing: ChatParsing, parser: Parser) -> None:
        self._parsing = parsing
        self._parser = parser
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._streamed_tools = False

    @property
    def _named(self) -> bool:
        return isinstance(self._parsing.request.tool_choice, ChatCompletionNamedToolChoiceParam)

    def step(self, text: str, token_ids: list[int], finished: bool) -> Step | None:
        """The delta `text` of `token_ids` parsed; None where vLLM sends nothing for it."""
        self._text.append(text)
        self._token_ids.extend(token_ids)
        request = self._parsing.request
        message: DeltaMessage | None = self._parser.parse_delta(
            text, token_ids, request, self._parsing.prompt_ids, finished=finished
        )
        if message is None:
            return None
        calls = message.tool_calls or []
        if calls:
            self._streamed_tools = True
        if request.parallel_tool_calls is False:
            calls = [call for call in calls if call.index == 0]
        return Step(
            content=message.content or "",
            reasoning=message.reasoning or "",
            tool_calls=[
                inference_pb2.ToolCallDelta(
                    index=call.index,
                    id=call.id or "",
                    name=(call.function.name if call.function else None) or "",
                    arguments=(call.function.arguments if call.function else None) or "",
                )
                for call in calls
            ],
        )

    def finish_reason(self, reason: int) -> int:
        """The streamed finish reason: tool_calls where calls were streamed and the engine
        stopped, unless one function was named."""
        if self._streamed_tools and not self._named and reason == common_pb2.FINISH_REASON_STOP:
            return common_pb2.FINISH_REASON_TOOL_CALLS
        return reason

    def reasoning_tokens(self) -> int:
        return self._parser.count_reasoning_tokens(tuple(self._token_ids))

    def whole(self, reason: int) -> inference_pb2.ParsedChoice:
        """The whole output parsed at once, with the finish reason the engine gave."""
        parsing, request = self._parsing, self._parsing.request
        parser = parsing._parser()
        parser.set_prompt_token_ids(parsing.prompt_ids)
        reasoning, content, calls = parser.parse(
            "".join(self._text), request, enable_auto_tools=parsing.parsers.enable_auto_tools,
            model_output_token_ids=self._token_ids,
        )  # fmt: skip
        forced = self._named or request.tool_choice == "required"
        auto = (
            request.tools is not None
            and request.tool_choice in ("auto", None)
            and parsing.parsers.enable_auto_tools
            and parsing.parsers.tools
        )
        if forced:
            content = content or ""
        elif not auto:
            calls = []
        calls = calls or []
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        answer = inference_pb2.ParsedChoice(
            tool_calls=[
                inference_pb2.ToolCall(
                    id=call.id or make_tool_call_id(), name=call.name, arguments=call.arguments
                )
                for call in calls
            ],
            finish_reason=reason,
        )
        if content is not None:
            answer.content = content
        if reasoning is not None:
            answer.reasoning = reasoning
        stopped = reason == common_pb2.FINISH_REASON_STOP
        if (auto and calls) or (request.tool_choice == "required" and stopped):
            answer.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS
        return answer
