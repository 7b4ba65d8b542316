"""The processor's checks of a request, made before any stage is called, so that a bad
request fails at once with the parameter it names, as `vllm serve` names it: the model,
media counts and placeholders, client image embeddings, and sampling (vLLM's own checks).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from transformers import PreTrainedTokenizerBase

from prism.engine.sampling import check_structured_output, to_vllm
from prism.media import embeds
from prism.media.audio import AUDIO
from prism.media.embeds import IMAGE_EMBEDS
from prism.media.image import IMAGE
from prism.media.modalities import BY_PART, MODALITIES
from prism.media.modality import Modality
from prism.media.policy import MediaPolicy
from prism.media.video import VIDEO
from prism.modes import Mode
from prism.proto.stage.v1 import encoder_pb2
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError, invalid
from prism.services.processor.inputs import ModelInputs


def check_placeholders(
    prompt_ids: list[int],
    modality: Modality,
    count: int,
    inputs: ModelInputs,
    policy: MediaPolicy,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """A prompt with `count` items of `modality` holds the model's placeholder once for
    each, which the engine expands to the item's tokens."""
    token = inputs.token(modality)
    what, name = modality.field, modality.name
    if token is None:
        raise invalid(f"this model does not accept {what}", what)
    if count > modality.limit(policy):
        raise invalid(f"at most {modality.limit(policy)} {what} per request, got {count}", what)
    placeholder = tokenizer.convert_ids_to_tokens(token)
    found = prompt_ids.count(token)
    if found != count:
        raise invalid(
            f"the prompt holds the {name} placeholder {placeholder!r} {found} times, "
            f"for {count} {what}: put it in the prompt once for each {name}",
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


def check_counts(counts: Mapping[str, int], policy: MediaPolicy, mode: Mode) -> None:
    """A conversation's media, counted by the `ContentPart` field they came in: images as
    pixels apart from the image embeddings a client sent."""
    images, embeddings = counts.get(IMAGE.part, 0), counts.get(IMAGE_EMBEDS.part, 0)
    if images and embeddings:
        # As vLLM: one modality comes as pixels or as embeddings, not both.
        raise invalid("a request cannot mix images and image_embeds", "messages")
    if embeddings and counts.get(VIDEO.part, 0) and not mode.has_encoder:
        raise invalid(f"in {mode.name} a request with image_embeds takes no videos", "messages")
    if embeddings and counts.get(AUDIO.part, 0):
        # Its engine encodes the audio from the file, and takes files or embeddings.
        raise invalid("a request with image_embeds takes no audio", "messages")
    for modality in MODALITIES:
        # Embeddings stand in for their modality's files and count against the same cap.
        found = sum(n for part, n in counts.items() if BY_PART[part].cap == modality.cap)
        if found > modality.limit(policy):
            raise invalid(
                f"at most {modality.limit(policy)} {modality.field} per request, got {found}",
                "messages",
            )


def check_sampling(
    sampling: common_pb2.SamplingParams,
    prompt_ids: list[int],
    max_model_len: int,
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # As vLLM refuses them: a prompt past the context, then one that leaves no room.
    if len(prompt_ids) > max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {len(prompt_ids)} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
        )
    if len(prompt_ids) == max_model_len:
        raise invalid("max_tokens must be at least 1, got 0.", "max_tokens")
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
