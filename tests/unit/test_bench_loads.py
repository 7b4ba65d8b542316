"""The benchmarks' loads: the LoRA load asks the base model and each adapter in turn, an
image each, as the image load asks the base model alone."""

from __future__ import annotations

from bench.lib.load import ADAPTERS, requests


def test_the_lora_load_asks_the_base_and_each_adapter_in_turn():
    bodies = requests("models/m", range(6), 8, "lora")
    assert [body["model"] for body in bodies] == ["models/m", *ADAPTERS] * 2
    for body in bodies:
        (image, question) = body["messages"][0]["content"]
        assert image["type"] == "image_url" and "image" in question["text"]
    assert {body["model"] for body in requests("models/m", range(6), 8)} == {"models/m"}
