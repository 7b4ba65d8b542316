"""The tiny random-weight checkpoints load with transformers and keep their token contract."""

import io
import pathlib
import wave

import numpy as np
import pytest
from safetensors import safe_open
from transformers import (
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    LlavaForConditionalGeneration,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2AudioForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
)

from prism.devtools.tiny_models import FAMILIES, IMAGE_FAMILIES, MARKERS, VOCAB_SIZE, build

MODEL_CLASSES = {
    "llava": LlavaForConditionalGeneration,
    "qwen2-vl": Qwen2VLForConditionalGeneration,
    "qwen2.5-vl": Qwen2_5_VLForConditionalGeneration,
}
PLACEHOLDERS = {
    "llava": "<image>",
    "qwen2-vl": "<|vision_start|><|image_pad|><|vision_end|>",
    "qwen2.5-vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
IMAGE_TOKENS = {"llava": "<image>", "qwen2-vl": "<|image_pad|>", "qwen2.5-vl": "<|image_pad|>"}
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module", params=IMAGE_FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    return family, build(family, tmp_path_factory.mktemp(family), seed=0)


def test_loads_with_transformers_without_key_mismatches(checkpoint):
    family, path = checkpoint
    model, info = AutoModelForImageTextToText.from_pretrained(path, output_loading_info=True)
    assert isinstance(model, MODEL_CLASSES[family])
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert model.dtype.is_floating_point and model.dtype.itemsize == 4
    assert model.config.get_text_config().vocab_size == len(AutoTokenizer.from_pretrained(path))


def test_tokenizer_round_trips_text_and_adds_no_special_tokens(checkpoint):
    _, path = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = "A red ball rolled past 3 trees — naïve café, 東京! "
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert ids == tokenizer(text, add_special_tokens=False).input_ids


def test_image_placeholder_is_one_special_token(checkpoint):
    family, path = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoModelForImageTextToText.from_pretrained(path).config
    ids = tokenizer.encode(f"look {IMAGE_TOKENS[family]} here", add_special_tokens=False)
    assert ids.count(config.image_token_id) == 1
    assert tokenizer.convert_ids_to_tokens(config.image_token_id) == IMAGE_TOKENS[family]
    assert config.image_token_id in tokenizer.all_special_ids


def test_chat_template_renders_image_parts_in_order(checkpoint):
    family, path = checkpoint
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "first"},
                {"type": "image"},
                {"type": "text", "text": "second"},
            ],
        },
    ]
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert f"first{PLACEHOLDERS[family]}second" in rendered
    assert "Be brief." in rendered
    assert rendered == processor.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(without_prompt) and rendered != without_prompt


def test_reasoning_and_tool_markers_are_plain_tokens(checkpoint):
    _, path = checkpoint
    tokenizer = AutoTokenizer.from_pretrained(path)
    for marker in MARKERS:
        (token,) = tokenizer.encode(marker, add_special_tokens=False)
        # Plain, as the markers of reasoning and tool calling models: kept in the text.
        assert token not in tokenizer.all_special_ids
        assert tokenizer.decode([token], skip_special_tokens=True) == marker
    assert len(tokenizer) == VOCAB_SIZE


def test_chat_template_renders_tools_calls_and_results_hermes_style(checkpoint):
    _, path = checkpoint
    tool = {"type": "function", "function": {"name": "get_time", "description": None,
                                             "parameters": {"type": "object"}}}  # fmt: skip
    call = {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": [], "tool_calls": [call]},
        {"role": "tool", "content": "noon"},
        {"role": "tool", "content": "UTC"},
    ]
    rendered = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, tools=[tool], tokenize=False, add_generation_prompt=True
    )
    assert (
        '<tools>\n{"type": "function", "function": {"name": "get_time", "description": null, '
        '"parameters": {"type": "object"}}}\n</tools>' in rendered
    )
    called = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert called in rendered
    # Consecutive results share one user turn.
    assert "<tool_response>\nnoon\n</tool_response><tool_response>\nUTC\n</tool_response>" in (
        rendered
    )


def test_llava_weights_use_vllm_vision_names(checkpoint):
    family, path = checkpoint
    if family != "llava":
        pytest.skip("only LLaVA's CLIP tower needs renaming for vLLM")
    with safe_open(path / WEIGHTS, "pt") as weights:
        names = weights.keys()
    vision = [name for name in names if name.startswith("vision_tower.")]
    assert vision
    assert all(name.startswith("vision_tower.vision_model.") for name in vision)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_gives_identical_files(family: str, tmp_path: pathlib.Path):
    first = build(family, tmp_path / "a", seed=7)
    second = build(family, tmp_path / "b", seed=7)
    other = build(family, tmp_path / "c", seed=8)
    for name in (WEIGHTS, "tokenizer.json", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert (first / WEIGHTS).read_bytes() != (other / WEIGHTS).read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def audio_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return build("qwen2-audio", tmp_path_factory.mktemp("qwen2-audio"), seed=0)


def test_qwen2_audio_loads_with_transformers_without_key_mismatches(audio_checkpoint):
    # The names vLLM's loader takes (the language model one level up) load here too.
    model, info = Qwen2AudioForConditionalGeneration.from_pretrained(
        audio_checkpoint, output_loading_info=True
    )
    assert not any(info.values()), info
    with safe_open(audio_checkpoint / WEIGHTS, "pt") as weights:
        names = list(weights.keys())
    assert "language_model.model.embed_tokens.weight" in names
    assert not [name for name in names if name.startswith("language_model.model.model.")]
    tokenizer = AutoTokenizer.from_pretrained(audio_checkpoint)
    assert model.config.text_config.vocab_size == len(tokenizer) == VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens(model.config.audio_token_index) == "<|AUDIO|>"


def test_qwen2_audio_template_numbers_audio_parts_and_the_processor_sizes_them(
    audio_checkpoint,
):
    messages = [{"role": "user", "content": [
        {"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"},
    ]}]  # fmt: skip
    processor = AutoProcessor.from_pretrained(audio_checkpoint)
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nand"
        "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\n" in rendered
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    # One second at 16 kHz, through a WAV file as a client sends it: 100 mel frames, 50
    # after the tower's stride, 25 tokens after its pooling; 50 for the two.
    file = io.BytesIO()
    with wave.open(file, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(np.zeros(16000, dtype=np.int16).tobytes())
    with wave.open(io.BytesIO(file.getvalue())) as read:
        rate = read.getframerate()
        audio = np.frombuffer(read.readframes(read.getnframes()), np.int16) / 32768.0
    inputs = processor(text=rendered, audio=[audio, audio], sampling_rate=rate)
    assert inputs["input_features"].shape[1:] == (128, 3000)
    assert list(inputs["input_ids"][0]).count(processor.audio_token_id) == 50


def test_a_lora_adapter_adapts_every_language_projection_and_no_tower(checkpoint, tmp_path):
    """`prism model build-lora`: PEFT's format, rank r, both matrices random (an adapter
    that changes the answers), seeded, the vision tower left alone."""
    import json

    from prism.devtools.lora import TARGETS, build_lora

    _, base = checkpoint
    first = build_lora(base, tmp_path / "a", rank=4, seed=1)
    config = json.loads((first / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == (
        "LORA", 4, list(TARGETS)
    )  # fmt: skip
    with safe_open(first / "adapter_model.safetensors", "pt") as adapter:
        keys = list(adapter.keys())
        assert keys and not [k for k in keys if "vision" in k or "visual" in k]
        assert {k.split(".")[-3] for k in keys} == set(TARGETS)
        for key in keys:
            tensor = adapter.get_tensor(key)
            assert tensor.abs().sum() > 0
            assert (tensor.shape[0] if "lora_A" in key else tensor.shape[1]) == 4
    again = build_lora(base, tmp_path / "b", rank=4, seed=1)
    other = build_lora(base, tmp_path / "c", rank=4, seed=2)
    data = {p.name: (p / "adapter_model.safetensors").read_bytes() for p in (first, again, other)}
    assert data["a"] == data["b"] != data["c"]
