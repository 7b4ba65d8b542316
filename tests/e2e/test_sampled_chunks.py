"""Sampled requests whose prompts are chunked, on vLLM's CPU backend, in P/D meshes (EP/D
and E/P/D), at concurrency.

vLLM rewinds a seeded request's generator after each chunk of its prompt by an offset that
only CUDA's generator has: on the CPU backend the first such request killed the engine, and
Prism seeds every P/D request (prefill and decode must draw the same first token), so
sampled requests with long prompts (the OpenAI default, `vllm bench serve`'s load) killed
P/D meshes. Engines here take 64 tokens a step, so that every prompt is chunked.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from support.cases import openai_client, run_oracle
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh

# Far over the step's 64 tokens: the prompt takes several chunks.
LONG = " ".join(f"word{i}" for i in range(200))
FLAGS = ["--max-num-seqs", "16", "--max-num-batched-tokens", "64"]


def messages(seed: int) -> list[dict]:
    return user(image_part(data_url(png(100 + seed))), f"{LONG} Question {seed}?")


@pytest.fixture(scope="module")
def seeded(models, tmp_path_factory) -> dict:
    """Offline vLLM's seeded samples (the default step: the prompt in one chunk)."""
    case = ("chat", messages(0), 12, {"temperature": 1.0, "seed": 1234})
    return run_oracle(models["llava"], tmp_path_factory.mktemp("o-seeded"), {"s": case})["s"]


@pytest.fixture(scope="module", params=["ep/d", "e/p/d"], ids=["ep-d", "e-p-d"])
def chunking_mesh(request, models, seeded, tmp_path_factory):
    # `seeded` first: the oracle's engine is gone before the mesh's start.
    running = start_mesh(
        "llava", request.param, models["llava"], tmp_path_factory.mktemp("logs"),
        vllm_flags=FLAGS,
    )  # fmt: skip
    yield running
    running.stop()


def test_a_seeded_sample_of_a_chunked_prompt_is_vllms_unchunked_one(chunking_mesh, seeded):
    client = openai_client(chunking_mesh)
    reply = client.chat.completions.create(
        model=chunking_mesh.model, messages=messages(0), max_tokens=12, temperature=1.0,
        seed=1234,
    )  # fmt: skip
    assert reply.usage.prompt_tokens > 64
    assert reply.choices[0].message.content == seeded["text"]


def test_sampled_requests_with_chunked_prompts_keep_the_engines_alive(chunking_mesh):
    client = openai_client(chunking_mesh)

    def ask(seed: int) -> int:
        # No temperature, no seed: the OpenAI default, sampled at 1.0.
        reply = client.chat.completions.create(
            model=chunking_mesh.model, messages=messages(seed), max_tokens=8,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(ask, range(1, 25))) == [8] * 24
    assert "EngineDeadError" not in chunking_mesh.log_path.read_text()
    # Prefill and decode, seeded alike, drew every first token alike.
    assert chunking_mesh.metrics("front")["prism_first_token_divergences_total"] == 0
