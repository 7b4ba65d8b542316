"""A chat's messages as vLLM's server hands them to the chat template."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError
from vllm.renderers.chat_utils import _postprocess_messages

from prism.rpc.errors import invalid


def postprocess_messages(conversation: list[dict]) -> None:
    """vLLM's own post-processing of `conversation`, in place: tool call arguments as
    objects, as templates expect them. Raises INVALID_ARGUMENT for `messages` where vLLM
    rejects them."""
    try:
        _postprocess_messages(conversation)
    except VLLMValidationError as exc:
        raise invalid(str(exc), "messages") from None
