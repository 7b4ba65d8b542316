"""Unit tests: client image embeddings, parsed without unpickling and checked against the
model's geometry."""

import io
import pickle

import numpy as np
import pytest
import safetensors.numpy
import torch
from transformers import LlavaConfig, Qwen2VLConfig

from prism.media import embeds
from prism.media.embeds import Geometry
from prism.proto.v1 import common_pb2
from prism.rpc.errors import PrismError


def test_safetensors_become_a_typed_embedding():
    array = np.arange(12, dtype=np.float16).reshape(3, 4)
    embedding = embeds.from_safetensors(safetensors.numpy.save({"embeds": array}), "p")
    assert (embedding.dtype, list(embedding.shape)) == ("float16", [3, 4])
    assert embedding.data == array.tobytes()


@pytest.mark.parametrize(
    "data,message",
    [
        (pickle.dumps(np.zeros((2, 2))), "pickles"),
        (b"", "not a valid safetensors"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}", "not a valid safetensors"),
        (safetensors.numpy.save({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}),
         "one tensor, not 2"),
        (safetensors.numpy.save({"a": np.zeros(2, np.int64)}), "not F32, F16 or BF16"),
    ],
    ids=["pickle", "empty", "garbage", "two tensors", "integers"],
)  # fmt: skip
def test_anything_but_one_float_safetensors_tensor_is_refused(data, message):
    with pytest.raises(PrismError, match=message) as info:
        embeds.from_safetensors(data, "messages[0].content[0].image_embeds")
    assert info.value.http_status == 400


def test_torch_save_is_refused_as_a_pickle():
    buffer = io.BytesIO()
    torch.save(torch.zeros(2, 2), buffer)
    with pytest.raises(PrismError, match="pickles"):
        embeds.from_safetensors(buffer.getvalue(), "p")


def test_geometry_of_the_families():
    llava = LlavaConfig()
    vision = llava.vision_config
    tokens = (vision.image_size // vision.patch_size) ** 2
    assert Geometry.of(llava) == Geometry(llava.text_config.hidden_size, tokens)
    qwen = Geometry.of(Qwen2VLConfig())
    assert qwen is not None and qwen.tokens_per_image is None and qwen.merge_size == 2
    assert qwen.tokens([1, 4, 6], "p") == 6


def _embedding(shape, grid=(), dtype="float32", size=4):
    data = bytes(int(np.prod(shape)) * size)
    return common_pb2.ImageEmbedding(dtype=dtype, shape=shape, data=data, image_grid_thw=grid)


@pytest.mark.parametrize(
    "embedding,message",
    [
        (_embedding([4, 8]), None),
        (_embedding([4, 8], dtype="bfloat16", size=2), None),
        (_embedding([4, 9]), r"shape \[4, 8\] .*got \[4, 9\]"),
        (_embedding([5, 8]), r"shape \[4, 8\]"),
        (_embedding([32]), r"shape \[4, 8\]"),
        (_embedding([4, 8], grid=[1, 2, 2]), "takes no image_grid_thw"),
        (_embedding([4, 8], dtype="int8", size=1), "dtype must be one of"),
        (common_pb2.ImageEmbedding(dtype="float32", shape=[4, 8], data=b"\0" * 12), "128 bytes"),
    ],
    ids=["ok", "bf16", "hidden", "tokens", "flat", "grid", "dtype", "short"],
)
def test_fixed_token_families(embedding, message):
    geometry = Geometry(hidden_size=8, tokens_per_image=4)
    if message is None:
        embeds.check(embedding, geometry, "p")
        return
    with pytest.raises(PrismError, match=message):
        embeds.check(embedding, geometry, "p")


def test_grid_families_count_tokens_from_the_grid():
    geometry = Geometry(hidden_size=8, tokens_per_image=None, merge_size=2)
    embeds.check(_embedding([6, 8], grid=[1, 4, 6]), geometry, "p")
    for grid, message in [([], "three positive"), ([1, 4, 6, 1], "three positive"),
                          ([1, 3, 6], "multiples of 2"), ([1, 4, 8], r"\[8, 8\]")]:  # fmt: skip
        with pytest.raises(PrismError, match=message):
            embeds.check(_embedding([6, 8], grid=grid), geometry, "p")


def test_a_handle_is_inline_and_named_by_its_contents():
    one, other = _embedding([4, 8]), _embedding([4, 8])
    other.data = b"\1" + other.data[1:]
    handle = embeds.to_handle(one)
    assert handle.embeddings.inline_data == one.data and list(handle.embeddings.shape) == [4, 8]
    assert handle.content_hash == embeds.to_handle(_embedding([4, 8])).content_hash
    assert handle.content_hash != embeds.to_handle(other).content_hash
