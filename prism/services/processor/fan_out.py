"""A request with n > 1 choices, fanned out and merged as vLLM's parallel sampling does it:
each choice is an engine request of its own, with its own seed; their messages come back
as one stream, with the request's usage over every choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

from prism.proto.stage.v1 import engine_pb2
from prism.proto.v1 import common_pb2
from prism.rpc.errors import invalid

Message = TypeVar("Message")


def split(
    request_id: str, sampling: common_pb2.SamplingParams
) -> list[tuple[str, common_pb2.SamplingParams]]:
    """Each choice's engine request id and sampling, as vLLM splits a request with n > 1:
    with a seed, choice i samples with seed + i."""
    n = max(sampling.n, 1)
    if n == 1:
        return [(request_id, sampling)]
    if sampling.HasField("seed") and sampling.seed + n - 1 >= 2**63:
        raise invalid(f"seed + n - 1 must be below 2**63 (seed {sampling.seed})", "seed")
    choices = []
    for index in range(n):
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        params.n = 1
        if sampling.HasField("seed"):
            params.seed = sampling.seed + index
        choices.append((f"{index}_{request_id}", params))
    return choices


class UsageTally:
    """A request's token counts, all choices together."""

    def __init__(self, prompt_tokens: int, choices: int) -> None:
        # What the processor counted, until the engine's first reply says.
        self._prompt = engine_pb2.PromptUsage(prompt_tokens=prompt_tokens)
        self._engine_said = False
        self.sent = [0] * choices
        self.reasoning = [0] * choices

    def prompt(self, usage: engine_pb2.PromptUsage) -> None:
        if not self._engine_said:
            self._engine_said = True
            self._prompt = engine_pb2.PromptUsage(
                prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens
            )

    def usage(self) -> common_pb2.Usage:
        completion = sum(self.sent)
        return common_pb2.Usage(
            prompt_tokens=self._prompt.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self._prompt.prompt_tokens + completion,
            cached_tokens=self._prompt.cached_tokens,
            reasoning_tokens=sum(self.reasoning),
        )


async def merge(streams: list[AsyncIterator[Message]]) -> AsyncIterator[Message]:
    """The messages of every stream as they come. The first error ends them all; closing
    this closes every stream, which frees what each holds."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Message]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
