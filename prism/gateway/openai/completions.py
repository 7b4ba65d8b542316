"""POST /v1/completions: an OpenAI completion request (one prompt, text or token ids) as
the processor's `CompleteRequest`, and its answer as vLLM's OpenAI server writes it."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from prism.gateway import bodies
from prism.gateway.client import ProcessorClient
from prism.gateway.openai import schemas
from prism.gateway.openai.protocol import (
    finish_reason,
    logprob,
    position_tokens,
    sampling,
    usage,
)
from prism.gateway.streaming import PlainChunks, respond
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import invalid

router = APIRouter()


def completion_request(body: Any, request_id: str = "") -> inference_pb2.CompleteRequest:
    """The processor's request for `body`: a CompletionRequest, or the JSON object of
    one."""
    body = bodies.typed(body, schemas.CompletionRequest)
    request = inference_pb2.CompleteRequest(
        request_id=request_id, model=body.model, sampling=sampling(body)
    )
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        request.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        request.token_ids.ids.extend(prompt)
    else:
        raise invalid(
            "'prompt' must be a non-empty string or list of token ids (one prompt)", "prompt"
        )
    if body.suffix:
        raise invalid("'suffix' is not supported", "suffix")
    if body.logprobs is not None:
        request.sampling.logprobs = body.logprobs
    if body.prompt_logprobs is not None:
        if body.prompt_logprobs and body.stream:
            raise invalid("'prompt_logprobs' are not available when streaming", "prompt_logprobs")
        request.sampling.prompt_logprobs = body.prompt_logprobs
    request.echo = bool(body.echo)
    return request


def completion_logprobs(
    positions: list[common_pb2.PositionLogprobs], logprobs: int, text_offset: int = 0
) -> dict[str, Any]:
    """A completion choice's `logprobs`, as vLLM's server writes it: `text_offset` is
    where the first token starts; each next one starts where the one before ends."""
    body: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                             "top_logprobs": []}  # fmt: skip
    for p in positions:
        body["text_offset"].append(text_offset)
        text_offset += len(p.token.token)
        body["tokens"].append(p.token.token)
        if not p.token.rank:
            # The prompt's first token, echoed: nothing came before it.
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        body["token_logprobs"].append(logprob(p.token.logprob))
        # OpenAI's completions list the asked number and the token itself.
        entries = position_tokens(p)[: logprobs + 1]
        body["top_logprobs"].append({t.token: logprob(t.logprob) for t in entries})
    return body


def prompt_logprobs(positions: list[common_pb2.PositionLogprobs]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` extension: per prompt token, its tokens by id."""
    return [
        {
            str(t.token_id): {
                "logprob": logprob(t.logprob),
                "rank": t.rank,
                "decoded_token": t.token,
            }
            for t in position_tokens(p)
        }
        if p.token.rank
        else None
        for p in positions
    ]


class CompletionAnswer:
    """One completion request's answer: an SSE chunk per message (`chunk`), or the whole
    body from each choice's messages (`final`)."""

    def __init__(self, request_id: str, params: common_pb2.SamplingParams) -> None:
        self.request_id = request_id
        self.created = int(time.time())
        # Top logprobs per position, where logprobs are asked for.
        self.logprobs = params.logprobs if params.HasField("logprobs") else None
        # Each choice's next text offset, for logprobs streamed chunk by chunk.
        self.offsets: dict[int, int] = {}
        self._plain = PlainChunks(request_id, "text_completion", self.created, b'"text":', b"")

    def _choice(self, index: int, replies: list[inference_pb2.CompleteResponse]) -> dict:
        body: dict[str, Any] = {
            "index": index,
            "text": "".join(reply.text for reply in replies),
            "logprobs": None,
            "finish_reason": finish_reason(replies[-1].finish_reason),
        }
        if self.logprobs is not None:
            positions = [p for reply in replies for p in reply.logprobs]
            logprobs = completion_logprobs(positions, self.logprobs, self.offsets.get(index, 0))
            if positions:
                end = logprobs["text_offset"][-1] + len(positions[-1].token.token)
                self.offsets[index] = end
            body["logprobs"] = logprobs
        prompt = [p for reply in replies for p in reply.prompt_logprobs]
        if prompt:
            body["prompt_logprobs"] = prompt_logprobs(prompt)
        return body

    def _head(self, reply: inference_pb2.CompleteResponse) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": reply.model}  # fmt: skip

    def chunk(self, reply: inference_pb2.CompleteResponse, first: bool) -> dict:
        return {**self._head(reply), "choices": [self._choice(reply.index, [reply])]}

    def plain(self, reply: inference_pb2.CompleteResponse, first: bool) -> bytes | None:
        if self.logprobs is not None or reply.prompt_logprobs:
            return None
        return self._plain.of(reply)

    def final(self, choices: dict[int, list], last: inference_pb2.CompleteResponse) -> dict:
        return {
            **self._head(last),
            "choices": [self._choice(index, replies) for index, replies in choices.items()],
            "usage": usage(last.usage),
        }


@router.post("/v1/completions", openapi_extra=bodies.openapi(schemas.CompletionRequest))
async def completions(request: Request) -> Response:
    body = bodies.decode(await request.body(), schemas.CompletionRequest)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    message = completion_request(body, request_id)
    processor: ProcessorClient = request.app.state.processor
    answer = CompletionAnswer(request_id, message.sampling)
    return await respond(request, body, answer, lambda: processor.complete(message))
