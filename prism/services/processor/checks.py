"""The processor's checks of a request, made before any stage is called, so that a bad
request fails at once with the parameter it names, as `vllm serve` names it: the model,
media counts and placeholders, client image embeddings, and sampling (vLLM's own checks).
"""

from __future__ import annotations

import dataclasses

import grpc
from transformers import PreTrainedTokenizerBase

from prism import embeds
from prism.engine.sampling import check_structured_output, to_vllm
from prism.media import MediaPolicy
from prism.modes import Mode
from prism.rpc.errors import PrismError, invalid
from prism.services.processor.inputs import ModelInputs
from prism.stage.v1 import encoder_pb2
from prism.v1 import common_pb2, errors_pb2


def check_model(model: str, served_model_name: str) -> None:
    if model and model != served_model_name:
        raise PrismError(
            grpc.StatusCode.NOT_FOUND,
            f"The model `{model}` does not exist.",
            reason=errors_pb2.ERROR_REASON_MODEL_NOT_FOUND,
            param="model",
        )


def check_placeholders(
    prompt_ids: list[int],
    images: int,
    inputs: ModelInputs,
    policy: MediaPolicy,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A prompt with images holds the model's image placeholder once for each, which
    the engine expands to the image's tokens."""
    token = inputs.image_token
    if token is None:
        raise invalid("this model does not accept images", "images")
    if images > policy.max_images:
        raise invalid(f"at most {policy.max_images} images per request, got {images}", "images")
    placeholder = tokenizer.convert_ids_to_tokens(token)
    found = prompt_ids.count(token)
    if found != images:
        raise invalid(
            f"the prompt holds the image placeholder {placeholder!r} {found} times, "
            f"for {images} images: put it in the prompt once for each image",
            "prompt",
        )


def checked_embedding(
    embedding: common_pb2.ImageEmbedding, inputs: ModelInputs, where: str
) -> encoder_pb2.EmbeddingHandle:
    """A client's image embedding as the pipeline takes it, once its shape and dtype are
    the model's."""
    param = f"{where}.image_embeds"
    if not inputs.embeddings_enabled:
        raise invalid("image_embeds are not enabled: start Prism with --enable-mm-embeds", param)
    if inputs.embeddings is None:
        raise invalid("image_embeds cannot be checked for this model's family", param)
    embeds.check(embedding, inputs.embeddings, param)
    return embeds.to_handle(embedding)


def check_counts(
    images: int, embeddings: int, videos: int, policy: MediaPolicy, mode: Mode
) -> None:
    """A conversation's media, counted: `images` as pixels, `embeddings` as image
    embeddings a client sent."""
    if images and embeddings:
        # As vLLM: one modality comes as pixels or as embeddings, not both.
        raise invalid("a request cannot mix images and image_embeds", "messages")
    if embeddings and videos and not mode.has_encoder:
        raise invalid(f"in {mode.name} a request with image_embeds takes no videos", "messages")
    if images + embeddings > policy.max_images:
        raise invalid(
            f"at most {policy.max_images} images per request, got {images + embeddings}",
            "messages",
        )
    if videos > policy.max_videos:
        raise invalid(f"at most {policy.max_videos} videos per request, got {videos}", "messages")


def check_sampling(
    sampling: common_pb2.SamplingParams,
    prompt_ids: list[int],
    max_model_len: int,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    if len(prompt_ids) >= max_model_len:
        raise invalid(
            f"prompt has {len(prompt_ids)} tokens, the model's context is {max_model_len}",
            "messages",
        )
    if sampling.HasField("max_tokens") and sampling.max_tokens > max_model_len:
        # As vLLM: past the context alone, an error; within it, clamped to what is left.
        raise invalid(
            f"max_tokens={sampling.max_tokens} cannot be greater than "
            f"max_model_len={max_model_len}. Please request fewer output tokens.",
            "max_tokens",
        )
    params = to_vllm(sampling)
    if sampling.n > 1:
        try:
            to_vllm(sampling, n=sampling.n)
        except PrismError as error:
            # Only `n` differs from the parameters just checked.
            raise dataclasses.replace(error, param="n") from None
    # vLLM's engine repeats this check: here it fails before any stage is called.
    check_structured_output(params, tokenizer)
