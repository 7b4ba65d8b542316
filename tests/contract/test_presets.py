"""The presets have the published architectures, and their streamed checkpoints load."""

import dataclasses
import json
import pathlib
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForMultimodalLM, AutoProcessor, AutoTokenizer

from prism.devtools import presets
from prism.devtools.presets import INDEX_FILE, PRESETS, Preset, build_preset, preset_config
from prism.devtools.tiny_models import _vllm_weight_name

# The totals the published checkpoints report (tied embeddings counted once).
PUBLISHED_PARAMETERS = {
    "qwen2-vl-2b": 2_208_985_600,
    "qwen2-vl-7b": 8_291_375_616,
    "llava-1.5-7b": 7_063_427_072,
    "qwen2-audio-7b": 8_397_094_912,
}


def _meta_parameters(config) -> int:
    with torch.device("meta"):
        model = AutoModelForMultimodalLM.from_config(config)
    # parameters() yields a tied weight once.
    return sum(parameter.numel() for parameter in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_parameter_count_is_the_published_total(name: str) -> None:
    assert _meta_parameters(preset_config(name)) == PUBLISHED_PARAMETERS[name]


def test_every_preset_is_checked_against_its_published_total() -> None:
    assert set(PRESETS) == set(PUBLISHED_PARAMETERS)


@pytest.mark.parametrize(
    ("name", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tied"),
    [
        ("qwen2-vl-2b", 1536, 28, 12, 2, 8960, 151936, True),
        ("qwen2-vl-7b", 3584, 28, 28, 4, 18944, 152064, False),
    ],
)
def test_qwen2_vl_config_is_published(
    name: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    tied: bool,
) -> None:
    config = preset_config(name)
    text, vision = config.text_config, config.vision_config
    assert config.architectures == ["Qwen2VLForConditionalGeneration"]
    assert config.dtype == torch.bfloat16
    assert config.tie_word_embeddings is tied
    assert (text.hidden_size, text.num_hidden_layers) == (hidden, layers)
    assert (text.num_attention_heads, text.num_key_value_heads) == (heads, kv_heads)
    assert (text.intermediate_size, text.vocab_size) == (intermediate, vocab)
    assert text.max_position_embeddings == 32768
    assert text.rms_norm_eps == 1e-6
    assert text.rope_parameters["rope_theta"] == 1e6
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert sum(text.rope_parameters["mrope_section"]) * 2 == hidden // heads
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.mlp_ratio) == (32, 1280, 16, 4)
    assert vision.hidden_size == hidden
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)


def test_llava_config_is_published() -> None:
    config = preset_config("llava-1.5-7b")
    text, vision = config.text_config, config.vision_config
    assert config.architectures == ["LlavaForConditionalGeneration"]
    assert config.dtype == torch.float16
    assert not config.tie_word_embeddings
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (4096, 32, 11008)
    assert (text.num_attention_heads, text.num_key_value_heads) == (32, 32)
    assert (text.vocab_size, text.max_position_embeddings, text.rms_norm_eps) == (32064, 4096, 1e-5)
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (
        1024,
        24,
        16,
    )
    assert (vision.intermediate_size, vision.image_size, vision.patch_size) == (4096, 336, 14)
    assert vision.projection_dim == 768
    assert config.vision_feature_layer == -2
    assert config.vision_feature_select_strategy == "default"
    assert config.projector_hidden_act == "gelu"
    assert config.image_seq_length == 576


def test_qwen2_audio_config_is_published() -> None:
    config = preset_config("qwen2-audio-7b")
    text, audio = config.text_config, config.audio_config
    assert config.architectures == ["Qwen2AudioForConditionalGeneration"]
    assert config.dtype == torch.bfloat16
    assert not config.tie_word_embeddings
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (4096, 32, 11008)
    assert (text.num_attention_heads, text.num_key_value_heads) == (32, 32)
    assert (text.vocab_size, text.max_position_embeddings) == (156032, 8192)
    assert text.rms_norm_eps == 1e-5
    assert text.rope_parameters["rope_theta"] == 10000
    assert (audio.d_model, audio.encoder_layers, audio.encoder_attention_heads) == (1280, 32, 20)
    assert (audio.encoder_ffn_dim, audio.num_mel_bins, audio.max_source_positions) == (
        5120,
        128,
        1500,
    )
    assert (audio.activation_function, audio.scale_embedding) == ("gelu", False)


PLACEHOLDERS = {"llava": "<image>", "qwen2-vl": "<|image_pad|>", "qwen2-audio": "<|AUDIO|>"}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_special_token_ids_are_the_tokenizers(name: str) -> None:
    tokenizer = presets._family_tokenizer(PRESETS[name].family)
    config = preset_config(name, tokenizer)
    placeholder = tokenizer.convert_tokens_to_ids(PLACEHOLDERS[PRESETS[name].family])
    audio = PRESETS[name].family == "qwen2-audio"
    assert (config.audio_token_index if audio else config.image_token_id) == placeholder
    assert config.text_config.eos_token_id == tokenizer.eos_token_id
    assert max(tokenizer.all_special_ids) < len(tokenizer) < config.text_config.vocab_size


def test_unknown_preset_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        build_preset("qwen2-vl-70b", tmp_path)


# Each preset's structure (family, dtype, tying, head width, GQA, vision settings) at a size
# that writes a few megabytes; the vocabulary stays larger than the tokenizer's.
SHRUNK_TEXT = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
SHRUNK = {
    "qwen2-vl-2b": (
        {**SHRUNK_TEXT, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 2048},
        {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 256},
    ),
    "qwen2-vl-7b": (
        {**SHRUNK_TEXT, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 2112},
        {"depth": 2, "embed_dim": 64, "num_heads": 2, "hidden_size": 256},
    ),
    "llava-1.5-7b": (
        {**SHRUNK_TEXT, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 2064},
        {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    ),
    "qwen2-audio-7b": (
        {**SHRUNK_TEXT, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 2080},
        {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 128},
    ),
}
SHARD_BYTES = 1 << 20


def _shrunk(name: str) -> Preset:
    preset = PRESETS[name]
    text, tower = SHRUNK[name]
    return dataclasses.replace(
        preset, text={**preset.text, **text}, tower={**preset.tower, **tower}
    )


@pytest.fixture(scope="module", params=sorted(SHRUNK))
def shrunk(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    name = f"shrunk-{request.param}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PRESETS, name, _shrunk(request.param))
        out = build_preset(name, tmp_path_factory.mktemp(name), seed=3, max_shard_bytes=SHARD_BYTES)
        yield name, PRESETS[request.param], preset_config(name), out


def _saved(out: pathlib.Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, "pt") as weights:
            tensors.update({name: weights.get_tensor(name) for name in weights.keys()})  # noqa: SIM118
    return tensors


def test_checkpoint_loads_without_key_mismatches_in_the_preset_dtype(shrunk) -> None:
    _, preset, _, out = shrunk
    model, info = AutoModelForMultimodalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert {parameter.dtype for parameter in model.parameters()} == {preset.dtype}
    tokens = len(AutoTokenizer.from_pretrained(out))
    output = model.get_output_embeddings().weight
    assert not output[tokens:].any()
    assert 0.015 < output[:tokens].float().std() < 0.025
    if preset.tie_word_embeddings:
        assert output is model.get_input_embeddings().weight


def test_weights_are_sharded_and_named_as_save_pretrained_names_them(shrunk, tmp_path) -> None:
    _, preset, config, out = shrunk
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(path.name for path in out.glob("*.safetensors"))
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    saved = _saved(out)
    assert {tensor.dtype for tensor in saved.values()} == {preset.dtype}
    assert set(index["weight_map"]) == set(saved)
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in saved.values())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in saved.values())
    for shard in shards:
        with safe_open(out / shard, "pt") as weights:
            assert weights.metadata() == {"format": "pt"}
        assert (out / shard).stat().st_mode & 0o777 == 0o644
        names = [name for name, file in index["weight_map"].items() if file == shard]
        assert len(names) == 1 or sum(saved[name].nbytes for name in names) <= SHARD_BYTES
    # A materialised model of the same config, saved by transformers, renamed as the tiny
    # builder renames it for vLLM.
    model = AutoModelForMultimodalLM.from_config(config)
    model.save_pretrained(tmp_path)
    expected = {_vllm_weight_name(name) for name in _saved(tmp_path)}
    assert set(saved) == expected
    assert {name: t.shape for name, t in saved.items()} == {
        name: t.shape
        for name, t in ((_vllm_weight_name(n), t) for n, t in _saved(tmp_path).items())
    }


def test_norms_are_ones_biases_zeros_and_matrices_random(shrunk) -> None:
    _, _, _, out = shrunk
    saved = _saved(out)
    norms = [t for name, t in saved.items() if "norm" in name and name.endswith("weight")]
    biases = [t for name, t in saved.items() if name.endswith("bias")]
    matrices = [t for name, t in saved.items() if t.dim() == 2 and "embed" not in name]
    assert norms and biases and matrices
    assert all(bool((t == 1).all()) for t in norms)
    assert not any(t.any() for t in biases)
    assert all(0.015 < t.float().std() < 0.025 for t in matrices if t.numel() > 4096)
    assert len({t.flatten()[:8].float().sum().item() for t in matrices}) == len(matrices)


def test_processor_is_configured_as_published(shrunk) -> None:
    _, preset, config, out = shrunk
    processor = AutoProcessor.from_pretrained(out)
    loaded = AutoConfig.from_pretrained(out)
    assert loaded.dtype == preset.dtype
    assert _fields(loaded.to_dict()) == _fields(config.to_dict())
    if preset.family == "qwen2-audio":
        # The released preprocessor_config.json.
        extractor = processor.feature_extractor
        assert (extractor.sampling_rate, extractor.feature_size) == (16000, 128)
        assert extractor.n_fft == 400
        assert (extractor.hop_length, extractor.chunk_length, extractor.nb_max_frames) == (
            160,
            30,
            3000,
        )
        return
    images = processor.image_processor
    assert list(images.image_mean) == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    assert list(images.image_std) == pytest.approx([0.26862954, 0.26130258, 0.27577711])
    if preset.family == "qwen2-vl":
        assert dict(images.size) == {"shortest_edge": 3136, "longest_edge": 12845056}
        assert (images.patch_size, images.merge_size, images.temporal_patch_size) == (14, 2, 2)
    else:
        assert dict(images.size) == {"shortest_edge": 336}
        assert dict(images.crop_size) == {"height": 336, "width": 336}
        assert processor.patch_size == 14
        assert processor.num_additional_image_tokens == 1
        assert processor.vision_feature_select_strategy == "default"


def _fields(config: dict[str, Any]) -> dict[str, Any]:
    # Where a config was read from, and the sub-configs' dtypes, which are not saved.
    return {
        key: _fields(value) if isinstance(value, dict) else value
        for key, value in config.items()
        if key not in ("_name_or_path", "dtype")
    }


def test_same_seed_writes_the_same_weights_and_another_seed_others(shrunk, tmp_path) -> None:
    name, _, _, out = shrunk
    first = _saved(out)
    # Unsharded this time: the sharding must not change a tensor's values.
    build_preset(name, tmp_path / "again", seed=3)
    build_preset(name, tmp_path / "other", seed=4, max_shard_bytes=SHARD_BYTES)
    again, other = _saved(tmp_path / "again"), _saved(tmp_path / "other")
    assert [path.name for path in (tmp_path / "again").glob("*.safetensors")] == [
        "model.safetensors"
    ]
    assert again.keys() == first.keys() == other.keys()
    assert all(torch.equal(again[key], first[key]) for key in first)
    changed = [key for key in first if not torch.equal(other[key], first[key])]
    assert changed == [key for key in first if (first[key] != first[key].flatten()[0]).any()]
