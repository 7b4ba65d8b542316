"""E/PD with `--transfer inline`: image embeddings travel inside the gRPC messages, so the
encoder needs no NIXL; the answers still equal offline vLLM's."""

from pathlib import Path

import openai
import pytest
from support.cases import CASES
from support.meshes import start_mesh


@pytest.fixture(scope="module")
def inline_mesh(models, oracle, tmp_path_factory):
    oracle("llava")
    mesh = start_mesh(
        "llava", "e/pd", models["llava"], tmp_path_factory.mktemp("inline"), transfer="inline"
    )
    yield mesh
    mesh.stop()


@pytest.mark.parametrize("case", ["one_image", "three_images"])
def test_inline_embeddings_give_offline_vllms_answer(inline_mesh, oracle, case):
    _, messages, max_tokens = CASES[case]
    client = openai.OpenAI(base_url=inline_mesh.base_url, api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=inline_mesh.model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    expected = oracle("llava")[case]
    assert reply.choices[0].message.content == expected["text"]
    assert reply.usage.prompt_tokens == expected["prompt_tokens"]


def test_the_encoder_never_loads_nixl_and_the_worker_reads_inline(inline_mesh):
    client = openai.OpenAI(base_url=inline_mesh.base_url, api_key="unused", max_retries=0)
    _, messages, _ = CASES["one_image"]
    client.chat.completions.create(
        model=inline_mesh.model, messages=messages, max_tokens=2, temperature=0
    )
    encoder = inline_mesh.mesh.stage("encoder").process.pid
    maps = Path(f"/proc/{encoder}/maps").read_text()
    assert "nixl" not in maps.lower()
    # The worker read the embeddings: bytes counted by its (inline) reader, none held.
    assert inline_mesh.metrics("worker")["prism_nixl_bytes_read_total"] > 0
    assert inline_mesh.metrics("encoder")["prism_nixl_pool_bytes_in_use"] == 0
