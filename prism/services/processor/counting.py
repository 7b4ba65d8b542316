"""CountTokens: the prompt tokens a chat request takes, rendered as Chat renders it (its
template and tools), each media item counted as the engine will lay it out (the model's HF
processor's count, which vLLM's expansion of these families matches), and nothing
generated."""

from __future__ import annotations

import asyncio

from prism.kv_index import lay_out
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import invalid
from prism.services.processor.adapters import ServedModels
from prism.services.processor.chat import ChatRenderer
from prism.services.processor.inputs import ModelInputs


class TokenCounter:
    """Counts prompts as `renderer` renders them, for the models `models` serves."""

    def __init__(self, renderer: ChatRenderer, models: ServedModels) -> None:
        self.renderer = renderer
        self.models = models
        # The model's inputs with its HF processor, loaded at the first count unless
        # `kv` routing loaded it already.
        given = renderer.inputs
        self._inputs: ModelInputs | None = given if given.processor is not None else None

    async def count(
        self, request: inference_pb2.CountTokensRequest
    ) -> inference_pb2.CountTokensResponse:
        chat = request.chat
        self.models.resolve(chat.model)
        prompt, _ = self.renderer.render(chat, chat.request_id or "count-tokens")
        prompt_ids, media = await prompt
        if self._inputs is None:
            given = self.renderer.inputs
            self._inputs = await asyncio.to_thread(
                ModelInputs.of, self.models.base, given.embeddings_enabled, True
            )
        inputs = self._inputs
        tokens, spans = lay_out(prompt_ids, inputs.placeholders, inputs.media_items(media))
        if len(spans) < sum(token in inputs.placeholders for token in prompt_ids):
            # A video's frames are sampled by its worker: only serving it tells its count.
            raise invalid("the tokens of this prompt's videos cannot be counted", "messages")
        return inference_pb2.CountTokensResponse(input_tokens=len(tokens))
