"""A chat request rendered as `vllm serve` renders it: its messages as the chat template
takes them (vLLM's own post-processing of tool calls included), templated and tokenized,
its images and videos loaded, and its tools and reasoning parsers set up
(prism.engine.parsing)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from prism.engine.chat import postprocess_messages
from prism.engine.parsing import ChatParsing, Parsers
from prism.media.embeds import IMAGE_EMBEDS
from prism.media.fetch import MediaLoader
from prism.media.image import IMAGE
from prism.media.modalities import BY_PART, MODALITIES
from prism.media.modality import Modality
from prism.media.prompt import PromptMedia
from prism.modes import Mode
from prism.proto.stage.v1 import encoder_pb2
from prism.proto.v1 import inference_pb2
from prism.rpc.errors import invalid
from prism.services.processor.checks import check_counts, checked_embedding
from prism.services.processor.inputs import ModelInputs, Prompt

# A request's log lines are the stage's: they name the processor, not this module.
log = logging.getLogger(__package__)

_ROLE_NAMES = {
    inference_pb2.ROLE_SYSTEM: "system",
    inference_pb2.ROLE_USER: "user",
    inference_pb2.ROLE_ASSISTANT: "assistant",
    # OpenAI's developer role plays the system role for models that know no other.
    inference_pb2.ROLE_DEVELOPER: "system",
    inference_pb2.ROLE_TOOL: "tool",
}


@dataclass
class _MediaParts:
    """A conversation's media parts, before loading."""

    # Each file modality's parts (an Image, a Video...) and their params, by modality name.
    files: dict[str, list[tuple[Any, str]]] = field(default_factory=dict)
    embeddings: list[encoder_pb2.EmbeddingHandle] = field(default_factory=list)

    def of(self, modality: Modality) -> list[tuple[Any, str]]:
        return self.files.get(modality.name, [])

    def counts(self) -> dict[str, int]:
        """How many parts came in each `ContentPart` field."""
        counts = {m.part: len(self.of(m)) for m in MODALITIES}
        return {**counts, IMAGE_EMBEDS.part: len(self.embeddings)}


class ChatRenderer:
    """Chat requests to prompts, for one model."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        parsers: Parsers,
        inputs: ModelInputs,
        loader: MediaLoader,
        mode: Mode,
    ) -> None:
        self.tokenizer = tokenizer
        self.parsers = parsers
        self.inputs = inputs
        self.loader = loader
        self.mode = mode

    def render(
        self, request: inference_pb2.ChatRequest, request_id: str
    ) -> tuple[Awaitable[Prompt], ChatParsing | None]:
        """The request's prompt, once its media are loaded, and its parsers where the server
        parses the output. What fails here fails before any media are fetched."""
        if request.sampling.HasField("prompt_logprobs"):
            raise invalid("prompt_logprobs are served on completions only", "prompt_logprobs")
        parsing = ChatParsing.of(self.parsers, self.tokenizer, request)
        conversation, parts = self._conversation(list(request.messages))
        prompt_ids = self._prompt_ids(conversation, parsing.tool_dicts)
        parsing.prompt_ids = prompt_ids
        parsing.adjust(request.sampling)
        return self._load(request_id, prompt_ids, parts), parsing if parsing.active else None

    async def _load(self, request_id: str, prompt_ids: list[int], parts: _MediaParts) -> Prompt:
        loaded = await asyncio.gather(*(
            asyncio.gather(*(self.loader.load(m, item, p) for item, p in parts.of(m)))
            for m in MODALITIES
        ))  # fmt: skip
        files = {m.field: list(items) for m, items in zip(MODALITIES, loaded, strict=True)}
        counted = ", ".join(f"{len(items)} {field}" for field, items in files.items())
        log.info("chat %s: %d prompt tokens, %s, %d image embeddings",
                 request_id, len(prompt_ids), counted, len(parts.embeddings))  # fmt: skip
        return prompt_ids, PromptMedia(**files, image_embeddings=parts.embeddings)

    def _conversation(
        self, messages: list[inference_pb2.ChatMessage]
    ) -> tuple[list[dict], _MediaParts]:
        if not messages:
            raise invalid("messages must not be empty", "messages")
        conversation, media = [], _MediaParts()
        for i, message in enumerate(messages):
            role = _ROLE_NAMES.get(message.role)
            if role is None:
                raise invalid(f"messages[{i}].role is missing or unknown", f"messages[{i}].role")
            parts: list[dict] = []
            for j, part in enumerate(message.content):
                kind = part.WhichOneof("part")
                where = f"messages[{i}].content[{j}]"
                if kind == "text":
                    parts.append({"type": "text", "text": part.text})
                    continue
                if kind is None:
                    raise invalid("content part is empty", where)
                if role != "user":
                    raise invalid("media are allowed in user messages only", where)
                modality = BY_PART[kind]
                # The chat template's part: embeddings stand where their modality's file would.
                parts.append({"type": modality.name})
                if modality.files is None:
                    media.embeddings.append(
                        checked_embedding(part.image_embedding, self.inputs, where)
                    )
                    continue
                # Named as OpenAI's request names it: image_url, video_url, audio_url.
                param = f"{where}.{modality.name}_url"
                # Images are not refused here: every model served takes them, and they
                # are held to the prompt's placeholders.
                if modality is not IMAGE and self.inputs.token(modality) is None:
                    raise invalid(f"this model does not accept {modality.name}", param)
                media.files.setdefault(modality.name, []).append(
                    (getattr(part, modality.part), param)
                )
            conversation.append(_message(role, parts, message, f"messages[{i}]"))
        postprocess_messages(conversation)
        check_counts(media.counts(), self.loader.policy, self.mode)
        return conversation, media

    def _prompt_ids(self, conversation: list[dict], tools: list[dict] | None) -> list[int]:
        try:
            prompt = self.tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja raises arbitrary errors for bad conversations
            raise invalid(f"chat template failed: {exc}", "messages") from None
        return self.tokenizer.encode(prompt, add_special_tokens=False)


def _message(role: str, parts: list[dict], message: inference_pb2.ChatMessage, where: str) -> dict:
    """A message as vLLM's server hands it to the chat template."""
    if message.tool_calls and role != "assistant":
        raise invalid("only assistant messages carry tool_calls", f"{where}.tool_calls")
    if role == "tool":
        # As vLLM: a tool's result is text, its parts joined by lines.
        content = "\n".join(part["text"] for part in parts)
        return {"role": role, "content": content, "tool_call_id": message.tool_call_id}
    result: dict[str, Any] = {"role": role, "content": parts}
    if message.tool_calls:
        result["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls
        ]  # fmt: skip
    return result
