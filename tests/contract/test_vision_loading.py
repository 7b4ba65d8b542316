"""The encoder's towers: only the towers' weights are read, from single-file and sharded
checkpoints under either naming; the vision path encodes exactly as the whole model that
transformers loads, and the audio path gives each clip the tokens the processor counts."""

from __future__ import annotations

import io
import shutil

import PIL.Image
import pytest
import torch
from support.content import audio
from transformers import AutoModelForImageTextToText, AutoProcessor

from prism.services.encoder.towers import (
    MediaEncoder,
    checkpoint_names,
    resolve_device,
    resolve_dtype,
)


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = (torch.rand(size[1], size[0], 3, generator=generator) * 255).to(torch.uint8)
    out = io.BytesIO()
    PIL.Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def test_checkpoint_names_are_matched_to_the_modules_own():
    own = {"embeddings.patch_embedding.weight", "post_layernorm.bias"}
    names = [
        "vision_tower.vision_model.embeddings.patch_embedding.weight",  # published LLaVA
        "model.vision_tower.post_layernorm.bias",  # transformers 5's own naming
        "language_model.model.layers.0.mlp.up_proj.weight",
        "model.my_vision_tower.post_layernorm.bias",  # another module that ends alike
    ]
    assert checkpoint_names(names, "vision_tower", own) == {
        names[0]: "embeddings.patch_embedding.weight",
        names[1]: "post_layernorm.bias",
    }
    assert checkpoint_names(["visual.blocks.0.attn.qkv.weight"], "visual",
                            {"blocks.0.attn.qkv.weight"}) == {
        "visual.blocks.0.attn.qkv.weight": "blocks.0.attn.qkv.weight"
    }  # fmt: skip


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_the_vision_path_alone_encodes_as_the_whole_model(models, family):
    model = str(models[family])
    vision = MediaEncoder(model)
    assert vision.model.language_model is None
    ours = vision.encode([png(1), png(2, (90, 60))])
    whole = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    vision.model = whole.model
    theirs = vision.encode([png(1), png(2, (90, 60))])
    for a, b in zip(ours, theirs, strict=True):
        assert a.grid_thw == b.grid_thw
        assert torch.equal(a.tensor, b.tensor)


def test_a_sharded_checkpoint_in_transformers_naming_loads_the_same(models, tmp_path):
    model = str(models["qwen2-vl"])
    whole = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    whole.save_pretrained(tmp_path, max_shard_size="200KB")
    for name in ("preprocessor_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "video_preprocessor_config.json",
                 "processor_config.json"):  # fmt: skip
        if (models["qwen2-vl"] / name).exists():
            shutil.copy(models["qwen2-vl"] / name, tmp_path / name)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    sharded, single = MediaEncoder(str(tmp_path)), MediaEncoder(model)
    (a,), (b,) = sharded.encode([png(3)]), single.encode([png(3)])
    assert torch.equal(a.tensor, b.tensor)


def test_a_checkpoint_without_the_tower_weights_is_refused(models, tmp_path):
    shutil.copytree(models["llava"], tmp_path, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    del weights["multi_modal_projector.linear_2.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 tower weights"):
        MediaEncoder(str(tmp_path))


@pytest.fixture(scope="module")
def qwen2_audio(tmp_path_factory: pytest.TempPathFactory) -> str:
    from prism.devtools.tiny_models import build

    return str(build("qwen2-audio", tmp_path_factory.mktemp("qwen2-audio"), seed=0))


def test_the_audio_path_reads_only_its_tower_and_sizes_each_clip_as_the_processor(qwen2_audio):
    model = qwen2_audio
    encoder = MediaEncoder(model)
    assert list(encoder.encoders) == ["audio"] and encoder.model.language_model is None
    clips = [audio(1, seconds=0.5), audio(2, seconds=2.0)]
    together = encoder.encode_audios(clips)
    processor = AutoProcessor.from_pretrained(model)
    for clip, embedding in zip(clips, together, strict=True):
        samples, _ = encoder.audio.decoder.decode(clip)
        ids = processor(text=["<|AUDIO|>"], audio=[samples])["input_ids"][0]
        assert embedding.tensor.shape[0] == list(ids).count(processor.audio_token_id)
    assert {e.tensor.shape[1] for e in together} == {encoder.config.text_config.hidden_size}
    # A clip's embeddings are its own, whatever it is batched with.
    assert torch.equal(encoder.encode_audios(clips[1:])[0].tensor, together[1].tensor)


class Config:
    def __init__(self, dtype: object) -> None:
        self.dtype = dtype


def test_the_dtype_is_float32_on_the_cpu_and_the_checkpoints_on_a_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", Config(torch.bfloat16), cpu) == torch.float32
    assert resolve_dtype("auto", Config(torch.float16), gpu) == torch.float16
    assert resolve_dtype("auto", Config("bfloat16"), gpu) == torch.bfloat16
    assert resolve_dtype("auto", Config(torch.float32), gpu) == torch.bfloat16
    assert resolve_dtype("float16", Config(torch.float32), cpu) == torch.float16
    with pytest.raises(ValueError, match="not a floating-point"):
        resolve_dtype("int8", Config(None), cpu)


def test_the_device_is_the_accelerator_when_there_is_one():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda:0")
