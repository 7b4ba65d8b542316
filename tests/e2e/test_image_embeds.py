"""End to end: image embeddings a client sends (`--enable-mm-embeds`) answer exactly as the
same images sent as pixels, in a mode where the engine encodes (EPD, Qwen2-VL: grids) and
in one where decode lays out what prefill took (E/P/D, LLaVA); bad embeddings are 400s."""

from __future__ import annotations

import base64
import pickle

import httpx
import pytest
import safetensors.torch
from support.cases import ask_case
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh

from prism.services.encoder.towers import MediaEncoder

PARAM = "messages[0].content[0].image_embeds"


@pytest.fixture(scope="module", params=[("qwen2-vl", "epd"), ("llava", "e/p/d")],
                ids=["qwen2-vl-epd", "llava-e-p-d"])  # fmt: skip
def embeds_mesh(request, models, tmp_path_factory):
    family, mode = request.param
    running = start_mesh(
        family, mode, models[family], tmp_path_factory.mktemp("logs"), enable_mm_embeds=True
    )
    yield running, MediaEncoder(str(models[family]))
    running.stop()


def embeds_part(vision: MediaEncoder, seed: int) -> dict:
    """The part a client sends for image `png(seed)`: the model's own embeddings of it."""
    (embedding,) = vision.encode([png(seed)])
    encoded = base64.b64encode(safetensors.torch.save({"embeds": embedding.tensor})).decode()
    if embedding.grid_thw:
        grid = list(embedding.grid_thw)
        return {"type": "image_embeds", "image_embeds": {"image_embeds": encoded,
                                                         "image_grid_thw": grid}}  # fmt: skip
    return {"type": "image_embeds", "image_embeds": encoded}


@pytest.mark.parametrize("seeds", [(1,), (3, 4, 5)], ids=["one", "three"])
def test_embeddings_answer_as_the_pixels_do(embeds_mesh, seeds):
    mesh, vision = embeds_mesh
    pixels = user(*(image_part(data_url(png(s))) for s in seeds), "What is in these images?")
    sent = user(*(embeds_part(vision, s) for s in seeds), "What is in these images?")
    expected, expected_usage = ask_case(mesh, ("chat", pixels, 16), stream=False)
    for stream in (False, True):
        text, usage = ask_case(mesh, ("chat", sent, 16), stream)
        assert text == expected
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            expected_usage.prompt_tokens, expected_usage.completion_tokens,
        )  # fmt: skip


def test_bad_embeddings_get_400_and_the_mesh_serves_on(embeds_mesh):
    mesh, vision = embeds_mesh
    good = embeds_part(vision, 1)
    encoded = good["image_embeds"]
    grid = None
    if isinstance(encoded, dict):
        encoded, grid = encoded["image_embeds"], encoded["image_grid_thw"]
    tensor = safetensors.torch.load(base64.b64decode(encoded))["embeds"]

    def part(value) -> dict:
        body = base64.b64encode(value).decode() if isinstance(value, bytes) else value
        if grid is not None:
            return {"type": "image_embeds",
                    "image_embeds": {"image_embeds": body, "image_grid_thw": grid}}  # fmt: skip
        return {"type": "image_embeds", "image_embeds": body}

    cases = [
        ("pickle", part(pickle.dumps(tensor.numpy())), "pickles"),
        ("hidden size", part(safetensors.torch.save({"e": tensor[:, :-1].contiguous()})), "shape"),
        ("token count", part(safetensors.torch.save({"e": tensor[:-1].contiguous()})), "shape"),
        ("mixed with pixels", None, "cannot mix"),
    ]
    for name, bad, message in cases:
        parts = [bad] if bad is not None else [good, image_part(data_url(png(2)))]
        body = {"model": mesh.model, "messages": user(*parts, "Hi"), "max_tokens": 4}
        reply = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=60)
        assert reply.status_code == 400, (name, reply.text)
        assert message in reply.json()["error"]["message"], name
    text, _ = ask_case(mesh, ("chat", user(good, "Hi"), 4), stream=False)
    assert text
