"""The answer of one choice, as vLLM's output processor makes it: the engine's token ids
turned into text deltas (stop strings included), their logprobs decoded, a chat's output
parsed into content, reasoning and tool calls, and each message stamped with the
request's usage so far. The prompt's share (its logprobs, its echo) rides on the first."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
from transformers import PreTrainedTokenizerBase

from prism.engine.detokenize import Delta, Detokenizer
from prism.engine.logprobs import Logprobs
from prism.engine.parsing import ChatParsing, ChoiceParsing, Step
from prism.engine.sampling import to_vllm
from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import PrismError
from prism.services.processor.failover import StageCalls
from prism.services.processor.fan_out import UsageTally

Response = TypeVar("Response", inference_pb2.ChatResponse, inference_pb2.CompleteResponse)


@dataclass
class RequestAnswer(Generic[Response]):
    """What the choices of one request share."""

    response_type: type[Response]
    request_id: str
    # The served model's name, which every message carries.
    model: str
    prompt_ids: list[int]
    tally: UsageTally
    # The prompt's text, which starts each choice (completions' `echo`).
    echo: str | None
    # A chat's tools and parsers, where the server parses the output.
    parsing: ChatParsing | None = None


class ChoiceAnswer(Generic[Response]):
    """One choice's engine replies as the request's messages."""

    def __init__(
        self,
        answer: RequestAnswer[Response],
        index: int,
        engine_id: str,
        sampling: common_pb2.SamplingParams,
        tokenizer: PreTrainedTokenizerBase,
    ) -> None:
        self.answer = answer
        self.index = index
        self.sampling = sampling
        params = to_vllm(sampling)
        self.detokenizer = Detokenizer(tokenizer, engine_id, answer.prompt_ids, params)
        self.logprobs = Logprobs(tokenizer, params)
        self.parsing: ChoiceParsing | None = (
            answer.parsing.choice() if answer.parsing is not None else None
        )
        # Whether the first message, which carries the prompt's share, has been made.
        self.started = False
        # Tokens whose text the parsers held back, sent with the next message.
        self.held: list[int] = []

    async def stream(
        self, replies: AsyncIterator[engine_pb2.GenerateResponse], call: StageCalls
    ) -> AsyncIterator[Response]:
        """The choice's messages from its engine `replies`, each with the request's usage so
        far. `call` carries the choice's stage calls, which an Abort cancels."""
        try:
            async for reply in replies:
                if reply.HasField("first"):
                    self.answer.tally.prompt(reply.first)
                delta = self.detokenizer.update(list(reply.token_ids), reply.last.reason)
                positions = self.logprobs.output(reply.logprobs[: len(delta.token_ids)])
                if not (delta.finished or delta.text or delta.token_ids):
                    continue
                if self.parsing is None:
                    yield self._message(delta, positions, reply)
                else:
                    message = self._parsed(self.parsing, delta, positions, reply)
                    if message is not None:
                        yield message
                if not delta.finished:
                    continue
                if reply.HasField("last"):
                    # The stage ends its stream after its last reply: read to that end, so
                    # that every stage sees its call complete rather than cancelled.
                    async for _ in replies:
                        pass
                return
        except asyncio.CancelledError:
            if not call.aborted:
                raise
            yield self._message(Delta("", [], common_pb2.FINISH_REASON_ABORT), [], None)
            return
        except grpc.aio.AioRpcError as exc:
            raise PrismError.from_rpc_error(exc) from None
        finally:
            # Closing the pipeline cancels its open stage call and frees what it holds.
            await replies.aclose()
        raise PrismError(grpc.StatusCode.INTERNAL, "worker stream ended without a finish reason")

    def _message(
        self, delta: Delta, positions: list, reply: engine_pb2.GenerateResponse | None
    ) -> Response:
        answer = self.answer
        message = answer.response_type(
            request_id=answer.request_id,
            model=answer.model,
            index=self.index,
            text=delta.text,
            token_ids=delta.token_ids,
            finish_reason=delta.finish_reason,
            logprobs=positions,
        )
        if delta.stop_sequence and answer.response_type is inference_pb2.ChatResponse:
            message.stop_sequence = delta.stop_sequence
        if not self.started:
            self.started = True
            self._add_prompt(message, reply)
        answer.tally.sent[self.index] = self.detokenizer.sent
        message.usage.CopyFrom(answer.tally.usage())
        return message

    def _add_prompt(self, message: Response, reply: engine_pb2.GenerateResponse | None) -> None:
        """The prompt's share of the first message: its logprobs on a completion, and its
        text, ids and logprobs in front where it is echoed."""
        answer = self.answer
        first = reply.first if reply is not None else engine_pb2.PromptUsage()
        prompt_positions = self.logprobs.prompt(answer.prompt_ids, first.prompt_logprobs)
        if answer.response_type is inference_pb2.CompleteResponse:
            message.prompt_logprobs.extend(prompt_positions)
        if answer.echo is not None:
            message.text = answer.echo + message.text
            message.token_ids[:0] = answer.prompt_ids
            if self.sampling.HasField("logprobs"):
                positions = [*prompt_positions, *message.logprobs]
                del message.logprobs[:]
                message.logprobs.extend(positions)

    def _parsed(
        self,
        parsing: ChoiceParsing,
        delta: Delta,
        positions: list,
        reply: engine_pb2.GenerateResponse,
    ) -> Response | None:
        """The message of `delta` where a chat's output is parsed; None where vLLM's
        server would send nothing for it."""
        step = parsing.step(delta.text, delta.token_ids, delta.finished)
        if step is None and not delta.finished and not positions:
            self.held.extend(delta.token_ids)
            return None
        step = step or Step()
        ids = [*self.held, *delta.token_ids]
        self.held.clear()
        reason = parsing.finish_reason(delta.finish_reason) if delta.finished else 0
        if delta.finished:
            self.answer.tally.reasoning[self.index] = parsing.reasoning_tokens()
        message = self._message(
            Delta(step.content, ids, reason, delta.stop_sequence), positions, reply
        )
        message.reasoning = step.reasoning
        message.tool_calls.extend(step.tool_calls)
        if delta.finished:
            message.parsed.CopyFrom(parsing.whole(delta.finish_reason))
        return message
