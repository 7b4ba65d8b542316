"""A completion request rendered as `vllm serve` renders it: its prompt as text or token
ids, with an image for each placeholder it holds, and the prompt's text where the answer
echoes it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from transformers import PreTrainedTokenizerBase

from prism.media.fetch import MediaLoader
from prism.media.image import IMAGE
from prism.media.prompt import PromptMedia
from prism.proto.v1 import common_pb2, inference_pb2
from prism.rpc.errors import invalid
from prism.services.processor.checks import check_placeholders
from prism.services.processor.inputs import ModelInputs, Prompt

# A request's log lines are the stage's: they name the processor, not this module.
log = logging.getLogger(__package__)


class CompletionRenderer:
    """Completion requests to prompts, for one model."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, inputs: ModelInputs, loader: MediaLoader
    ) -> None:
        self.tokenizer = tokenizer
        self.inputs = inputs
        self.loader = loader

    def render(
        self, request: inference_pb2.CompleteRequest, request_id: str
    ) -> tuple[Awaitable[Prompt], str | None]:
        """The request's prompt, once its images are loaded, and the prompt's text where
        each choice starts with it (`echo`)."""
        kind = request.WhichOneof("prompt")
        if kind == "text" and request.text:
            prompt_ids = self.tokenizer.encode(request.text)
        elif kind == "token_ids" and request.token_ids.ids:
            prompt_ids = list(request.token_ids.ids)
            vocab = len(self.tokenizer)
            if max(prompt_ids) >= vocab:
                raise invalid(f"prompt token ids must be below {vocab}", "prompt")
        else:
            raise invalid("prompt must not be empty", "prompt")
        # A completion's media are images alone (CompleteRequest.images).
        images = list(IMAGE.items(request))
        if images:
            check_placeholders(
                prompt_ids, IMAGE, len(images), self.inputs, self.loader.policy, self.tokenizer
            )
        echo = None
        if request.echo:
            echo = request.text if kind == "text" else self.tokenizer.decode(prompt_ids)
            sampling = request.sampling
            if sampling.HasField("logprobs") and not sampling.HasField("prompt_logprobs"):
                # As vLLM: the echoed prompt comes with its logprobs.
                sampling.prompt_logprobs = sampling.logprobs
        return self._load(request_id, prompt_ids, images), echo

    async def _load(
        self, request_id: str, prompt_ids: list[int], images: list[common_pb2.Image]
    ) -> Prompt:
        loaded = await asyncio.gather(
            *(self.loader.load(IMAGE, image, f"images[{i}]") for i, image in enumerate(images))
        )
        log.info("completion %s: %d prompt tokens, %d images",
                 request_id, len(prompt_ids), len(loaded))  # fmt: skip
        return prompt_ids, PromptMedia(list(loaded))
