"""Encoding that never fails a request (prism.services.processor.encode_fallback): with
every encoder of an E/PD or E/P/D mesh killed, the worker that would read their embeddings
encodes the images from the pixels and answers as offline vLLM does (LLaVA and Qwen2-VL;
audio in test_audio_modes.py); the processor counts
each such request; with an encoder back, it encodes again."""

from __future__ import annotations

import os
import signal

import pytest
from support.cases import assert_equals_offline_vllm
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh, stream_outcome
from support.waiting import wait_for


@pytest.mark.parametrize(("family", "mode"), [("llava", "e/pd"), ("qwen2-vl", "e/p/d")])
def test_with_every_encoder_killed_the_worker_encodes_and_answers_the_same(
    family, mode, models, oracle, tmp_path
):
    expected = oracle(family)
    mesh = start_mesh(family, mode, models[family], tmp_path)
    try:
        os.killpg(mesh.mesh.stage("encoder-0").process.pid, signal.SIGKILL)
        mesh.mesh.stage("encoder-0").process.wait(timeout=30)

        def fallbacks() -> float:
            return mesh.metric("front", "prism_encode_fallbacks_total")

        # Every case (three with images) answered as offline vLLM, none of them refused.
        assert_equals_offline_vllm(mesh, expected)
        assert fallbacks() == 3, mesh.log_tail()

        with open(mesh.log_path, "a") as log:
            mesh.mesh.restart("encoder-0", log=log)
        body = {"model": mesh.model, "max_tokens": 8, "temperature": 0,
                "messages": user(image_part(data_url(png(91))), "What is it?")}  # fmt: skip

        def encoded_again() -> bool:
            # The processor's probes bring the encoder back into routing within seconds.
            assert stream_outcome(mesh.base_url, body) == "completed"
            return mesh.metric("encoder-0", "prism_nixl_published_total") > 0

        assert wait_for(encoded_again, timeout=60, period=1), mesh.log_tail()
        counted = fallbacks()
        assert_equals_offline_vllm(mesh, expected)
        assert fallbacks() == counted
    finally:
        mesh.stop()
