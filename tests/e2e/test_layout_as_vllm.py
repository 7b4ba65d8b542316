"""The processor lays a prompt's images and clips out as vLLM does: for each tiny family,
the token ids and item spans `lay_out` makes of a templated chat match those vLLM's own
multimodal processor makes of it, each item named by the content hash workers give vLLM as
its uuid.

Not a unit test: vLLM inspects a model's architecture in a subprocess (once per machine,
then from its cache)."""

from __future__ import annotations

import io

import PIL.Image
import pytest
from support.cases import FAMILIES
from support.content import audio
from transformers import AutoTokenizer
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY

from prism.devtools.tiny_models import build
from prism.kv_index import MediaSpan, lay_out
from prism.media.audio import AudioDecoder, check_audio
from prism.media.image import check_image
from prism.media.modality import content_hash
from prism.media.policy import MediaPolicy
from prism.media.prompt import PromptMedia
from prism.services.processor.inputs import ModelInputs


def png(size: tuple[int, int], shade: int) -> bytes:
    out = io.BytesIO()
    PIL.Image.new("RGB", size, (shade, 0, 0)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("family", FAMILIES)
def test_images_lie_where_vllm_puts_them(models, family):
    model = str(models[family])
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversation = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "and"},
        {"type": "image"},
    ]}]  # fmt: skip
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    # Sizes that give the grid families different counts.
    images = [check_image(png(size, i), MediaPolicy(), "image") for i, size in
              enumerate([(64, 48), (200, 300)])]  # fmt: skip
    inputs = ModelInputs.of(model, enable_mm_embeds=False, count_tokens=True)

    tokens, spans = lay_out(prompt, inputs.placeholders, inputs.media_items(PromptMedia(images)))

    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=model))
    pixels = [PIL.Image.open(io.BytesIO(image.data)) for image in images]
    uuids = [content_hash(image.data) for image in images]
    vllm = processor(prompt, processor.info.parse_mm_data({"image": pixels}), {"image": uuids})
    assert tokens == vllm["prompt_token_ids"]
    assert spans == [
        MediaSpan(identifier, place.offset, place.length)
        for identifier, place in zip(vllm["mm_hashes"]["image"], vllm["mm_placeholders"]["image"],
                                     strict=True)
    ]  # fmt: skip
    assert len({span.length for span in spans}) == (2 if family == "qwen2-vl" else 1)


def test_clips_lie_where_vllm_puts_them_up_to_one_it_resamples(tmp_path):
    model = str(build("qwen2-audio", tmp_path / "qwen2-audio", seed=0))
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversation = [{"role": "user", "content": [
        {"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"},
        {"type": "audio"},
    ]}]  # fmt: skip
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    # Lengths that give different counts, one past the 30 s window, one to resample.
    limits = MediaPolicy().audio
    clips = [check_audio(audio(seed, seconds, rate), limits, "audio") for seed, seconds, rate in
             [(1, 0.7, 16000), (2, 31.0, 16000), (3, 1.0, 44100)]]  # fmt: skip
    inputs = ModelInputs.of(model, enable_mm_embeds=False, count_tokens=True)

    media = PromptMedia(audios=clips)
    tokens, spans = lay_out(prompt, inputs.placeholders, inputs.media_items(media))

    processor = MULTIMODAL_REGISTRY.create_processor(ModelConfig(model=model))
    decoder = AudioDecoder(16000)
    samples = [decoder.decode(clip.data) for clip in clips]
    uuids = [content_hash(clip.data) for clip in clips]
    vllm = processor(prompt, processor.info.parse_mm_data({"audio": samples}), {"audio": uuids})
    # Up to the clip at 44.1 kHz, whose length once resampled the processor leaves unsaid.
    placed = vllm["mm_placeholders"]["audio"]
    assert tokens == vllm["prompt_token_ids"][: placed[2].offset]
    assert spans == [
        MediaSpan(identifier, place.offset, place.length)
        for identifier, place in zip(vllm["mm_hashes"]["audio"][:2], placed[:2], strict=True)
    ]  # fmt: skip
    assert spans[0].length < spans[1].length == 750
