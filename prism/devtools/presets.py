"""Random-weight checkpoints with the exact architecture of published multimodal models.

`build_preset` writes a directory that both `transformers` and vLLM load, shaped like the
published checkpoint it copies: the same config (every size, layer and head count, rope and
vision or audio tower settings, vocabulary size and dtype), the image processor or audio
feature extractor as the checkpoint configures it, and sharded safetensors weights. Only
the tokenizer is not the real one (it cannot be downloaded here): it is the tiny models'
trained tokenizer with the family's special tokens, and the embeddings keep the published
vocabulary size, the rows past the tokenizer being padding.

The weights are random and are streamed shard by shard, so that building a 7B model needs
about one shard of memory rather than the whole model.
"""

import hashlib
import json
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import (
    AutoModelForMultimodalLM,
    CLIPImageProcessor,
    GenerationConfig,
    LlavaConfig,
    LlavaProcessor,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    ProcessorMixin,
    Qwen2AudioConfig,
    Qwen2AudioProcessor,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)
from transformers.core_model_loading import revert_weight_conversion
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.modeling_utils import remove_tied_weights_from_state_dict

from prism.devtools.tiny_models import (
    LLAVA_TEMPLATE,
    QWEN2_AUDIO_TEMPLATE,
    QWEN2_VL_TEMPLATE,
    WEIGHTS_FILE,
    _vllm_weight_name,
    llava_tokenizer,
    qwen2_audio_extractor,
    qwen2_audio_tokenizer,
    qwen_tokenizer,
)

MAX_SHARD_BYTES = 2 << 30
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class Preset:
    """A published checkpoint's architecture. `text` and `tower` hold its config.json's
    language model and vision or audio tower fields (transformers 5 spelling); `family`
    names the tiny_models family whose tokenizer and chat template stand in for the real
    ones."""

    checkpoint: str
    family: str
    dtype: torch.dtype
    tie_word_embeddings: bool
    text: dict[str, Any]
    tower: dict[str, Any]

    @property
    def description(self) -> str:
        return f"{self.checkpoint} architecture, random {str(self.dtype).removeprefix('torch.')}"


_QWEN2_VL_TEXT = {
    "hidden_act": "silu",
    "num_hidden_layers": 28,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "use_sliding_window": False,
    "sliding_window": 32768,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    # M-RoPE: the 64 rotary frequency pairs of a 128-wide head split over (temporal,
    # height, width).
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
}
_QWEN2_VL_VISION = {
    "depth": 32,
    "embed_dim": 1280,
    "num_heads": 16,
    "mlp_ratio": 4,
    "hidden_act": "quick_gelu",
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "initializer_range": 0.02,
}

PRESETS: dict[str, Preset] = {
    "qwen2-vl-2b": Preset(
        checkpoint="Qwen/Qwen2-VL-2B-Instruct",
        family="qwen2-vl",
        dtype=torch.bfloat16,
        tie_word_embeddings=True,
        text={
            **_QWEN2_VL_TEXT,
            "vocab_size": 151936,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
        },
        tower={**_QWEN2_VL_VISION, "hidden_size": 1536},
    ),
    "qwen2-vl-7b": Preset(
        checkpoint="Qwen/Qwen2-VL-7B-Instruct",
        family="qwen2-vl",
        dtype=torch.bfloat16,
        tie_word_embeddings=False,
        text={
            **_QWEN2_VL_TEXT,
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
        },
        tower={**_QWEN2_VL_VISION, "hidden_size": 3584},
    ),
    "llava-1.5-7b": Preset(
        checkpoint="llava-hf/llava-1.5-7b-hf",
        family="llava",
        dtype=torch.float16,
        tie_word_embeddings=False,
        # Vicuna-7B v1.5, i.e. Llama-2-7B; its config.json leaves most of these at Llama's
        # defaults, spelled out here so that a change of default cannot change the model.
        text={
            "model_type": "llama",
            "vocab_size": 32064,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 128,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.02,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        # CLIP ViT-L/14 at 336 pixels.
        tower={
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "image_size": 336,
            "patch_size": 14,
            "projection_dim": 768,
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-5,
            "initializer_range": 0.02,
        },
    ),
    "qwen2-audio-7b": Preset(
        checkpoint="Qwen/Qwen2-Audio-7B-Instruct",
        family="qwen2-audio",
        dtype=torch.bfloat16,
        tie_word_embeddings=False,
        # Qwen-7B's shape: the released config.json gives its vocabulary, feed-forward width
        # and context, and leaves the rest at Qwen2's defaults, spelled out here.
        text={
            "model_type": "qwen2",
            "vocab_size": 156032,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "initializer_range": 0.02,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
        # Whisper-large-v3's encoder: 128 mel bins, a 30 s window (1500 positions).
        tower={
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": 128,
            "encoder_layers": 32,
            "encoder_attention_heads": 20,
            "encoder_ffn_dim": 5120,
            "d_model": 1280,
            "activation_function": "gelu",
            "scale_embedding": False,
            "max_source_positions": 1500,
        },
    ),
}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    return {
        "llava": llava_tokenizer,
        "qwen2-vl": qwen_tokenizer,
        "qwen2-audio": qwen2_audio_tokenizer,
    }[family]()


def _qwen2_vl_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        vision_config=preset.tower,
        text_config={
            **preset.text,
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )


def _llava_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    patches = preset.tower["image_size"] // preset.tower["patch_size"]
    return LlavaConfig(
        vision_config=preset.tower,
        text_config={
            **preset.text,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": preset.tie_word_embeddings,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=patches**2,
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )


def _qwen2_vl_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    # The published preprocessor_config.json: min_pixels 3136 and max_pixels 12845056.
    common = {
        "patch_size": preset.tower["patch_size"],
        "merge_size": preset.tower["spatial_merge_size"],
        "temporal_patch_size": preset.tower["temporal_patch_size"],
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
    }
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**common),
        tokenizer=tokenizer,
        # As the tiny builder: transformers' upcoming default, which also silences a warning.
        video_processor=Qwen2VLVideoProcessor(**common, cap_pixels_per_frame=True),
        chat_template=QWEN2_VL_TEMPLATE,
    )


def _llava_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    image = preset.tower["image_size"]
    return LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": image},
            crop_size={"height": image, "width": image},
            image_mean=OPENAI_CLIP_MEAN,
            image_std=OPENAI_CLIP_STD,
        ),
        tokenizer=tokenizer,
        patch_size=preset.tower["patch_size"],
        # CLIP's class token.
        num_additional_image_tokens=1,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE,
    )


def _qwen2_audio_config(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> PreTrainedConfig:
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2AudioConfig(
        audio_config=preset.tower,
        text_config={
            **preset.text,
            "bos_token_id": ids("<|endoftext|>"),
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "tie_word_embeddings": preset.tie_word_embeddings,
        },
        audio_token_index=ids("<|AUDIO|>"),
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )


def _qwen2_audio_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> ProcessorMixin:
    return Qwen2AudioProcessor(
        qwen2_audio_extractor(), tokenizer, chat_template=QWEN2_AUDIO_TEMPLATE
    )


@dataclass(frozen=True)
class _Family:
    architecture: str
    config: Callable[[Preset, PreTrainedTokenizerFast], PreTrainedConfig]
    processor: Callable[[Preset, PreTrainedTokenizerFast], ProcessorMixin]


_FAMILIES = {
    "qwen2-vl": _Family("Qwen2VLForConditionalGeneration", _qwen2_vl_config, _qwen2_vl_processor),
    "llava": _Family("LlavaForConditionalGeneration", _llava_config, _llava_processor),
    "qwen2-audio": _Family(
        "Qwen2AudioForConditionalGeneration", _qwen2_audio_config, _qwen2_audio_processor
    ),
}


def preset_config(name: str, tokenizer: PreTrainedTokenizerFast | None = None) -> PreTrainedConfig:
    """The transformers config of preset `name`, its special token ids those of `tokenizer`
    (by default the family's tokenizer, trained in about a second)."""
    preset = _preset(name)
    tokenizer = tokenizer or _family_tokenizer(preset.family)
    family = _FAMILIES[preset.family]
    config = family.config(preset, tokenizer)
    # What save_pretrained would record, and how vLLM picks its model class.
    config.architectures = [family.architecture]
    return config


@dataclass(frozen=True)
class _Weight:
    """How to fill one saved tensor."""

    shape: tuple[int, ...]
    fill: str  # "normal", "ones" or "zeros"
    # Rows from this one on are vocabulary padding, left zero.
    padding_from: int | None = None


def _meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    with torch.device("meta"):
        return AutoModelForMultimodalLM.from_config(config)


def _weights(config: PreTrainedConfig, tokens: int | None) -> dict[str, _Weight]:
    """Every tensor a saved checkpoint of `config` holds, under its saved name, in the order
    transformers saves them."""
    model = _meta_model(config)
    embeddings = {
        id(module.weight)
        for module in (model.get_input_embeddings(), model.get_output_embeddings())
        if module is not None
    }
    norms = {
        id(parameter)
        for module in model.modules()
        if "Norm" in type(module).__name__
        for parameter in module.parameters(recurse=False)
    }
    # The names save_pretrained writes: tied copies dropped, then transformers' renamings
    # reverted to the checkpoint format. The renamings pass the (meta) tensors through, so
    # the tensors' identities lead back to the parameters.
    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    parameters = {id(tensor): model.get_parameter(name) for name, tensor in state.items()}
    weights = {}
    for name, tensor in revert_weight_conversion(model, state).items():
        if id(tensor) not in parameters:
            raise RuntimeError(f"{name}: saving {type(model).__name__} converts weights")
        parameter = parameters[id(tensor)]
        if name.endswith("bias"):
            fill = "zeros"
        elif id(parameter) in norms:
            fill = "ones"
        else:
            fill = "normal"
        padding = tokens if id(parameter) in embeddings and tokens is not None else None
        weights[_vllm_weight_name(name)] = _Weight(tuple(tensor.shape), fill, padding)
    return weights


def _shards(sizes: dict[str, int], max_shard_bytes: int) -> Iterator[list[str]]:
    # Greedily in saving order, as transformers splits: a tensor larger than a shard gets
    # one of its own.
    shard: list[str] = []
    total = 0
    for name, size in sizes.items():
        if shard and total + size > max_shard_bytes:
            yield shard
            shard, total = [], 0
        shard.append(name)
        total += size
    if shard:
        yield shard


def _tensor_seed(seed: int, name: str) -> int:
    # Seeded per tensor, so that a tensor's values depend neither on the order of generation
    # nor on the sharding.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def _tensor(name: str, weight: _Weight, dtype: torch.dtype, std: float, seed: int) -> torch.Tensor:
    tensor = torch.empty(weight.shape, dtype=dtype)
    if weight.fill == "zeros":
        return tensor.zero_()
    if weight.fill == "ones":
        return tensor.fill_(1.0)
    # In place and in the checkpoint's dtype: no float32 copy, about 5 s per 10^9 values.
    tensor.normal_(0.0, std, generator=torch.Generator().manual_seed(_tensor_seed(seed, name)))
    if weight.padding_from is not None:
        # Zero rows give the padding ids zero logits, below the largest of the tokenizer's
        # random ones, so that greedy decoding stays on ids the tokenizer can decode.
        tensor[weight.padding_from :].zero_()
    return tensor


def write_weights(
    config: PreTrainedConfig,
    out: pathlib.Path,
    seed: int = 0,
    tokens: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[pathlib.Path]:
    """Write random weights for `config` into `out` in `config.dtype`, shard by shard as
    `save_pretrained` names and indexes them, and return the files written. Embedding rows
    from `tokens` on (the vocabulary past the tokenizer) are zero. Normal(0,
    initializer_range) matrices and embeddings, unit norm weights, zero biases."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype)
    std = config.get_text_config().initializer_range
    weights = _weights(config, tokens)
    counts = {name: torch.Size(weight.shape).numel() for name, weight in weights.items()}
    sizes = {name: count * dtype.itemsize for name, count in counts.items()}
    shards = list(_shards(sizes, max_shard_bytes))
    # Drop weights of an earlier build, which a different sharding would leave behind.
    for stale in [*out.glob("model-*-of-*.safetensors"), out / WEIGHTS_FILE, out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        files = [out / WEIGHTS_FILE]
    else:
        files = [
            out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            for i in range(1, len(shards) + 1)
        ]
    weight_map = {}
    for path, names in zip(files, shards, strict=True):
        save_file(
            {name: _tensor(name, weights[name], dtype, std, seed) for name in names},
            path,
            metadata={"format": "pt"},
        )
        # safetensors writes through a private temporary file (mode 0600).
        path.chmod(0o644)
        weight_map.update(dict.fromkeys(names, path.name))
    if len(files) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(counts.values()),
                "total_size": sum(sizes.values()),
            },
            "weight_map": weight_map,
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(out / INDEX_FILE)
    return files


def build_preset(
    name: str, out: pathlib.Path, seed: int = 0, max_shard_bytes: int = MAX_SHARD_BYTES
) -> pathlib.Path:
    """Write a random-weight checkpoint with preset `name`'s architecture (PRESETS) into
    `out` and return `out`; the same seed writes the same weights."""
    preset = _preset(name)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _family_tokenizer(preset.family)
    config = preset_config(name, tokenizer)
    processor = _FAMILIES[preset.family].processor(preset, tokenizer)
    processor.save_pretrained(out)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    write_weights(config, out, seed, tokens=len(tokenizer), max_shard_bytes=max_shard_bytes)
    return out
