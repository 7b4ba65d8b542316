"""End to end: LoRA adapters in every mode (`--enable-lora --lora-modules`), each named by
a request's `model` as `vllm serve` names them.

Every shared mesh serves two random adapters of its model (fixtures.adapters): an
adapter's image chats equal offline vLLM's with that adapter's `LoRARequest`, token for
token (in P/D, prefill and decode both apply it); the base model's and both adapters'
answers sent together at concurrency 16 are each their own; /v1/models lists each
adapter with the base as its parent; an adapter the mesh does not hold is a 404 that
names it. An adapter loaded at run time is served by every engine, a worker that does not
hold it loading it from the request, until it is unloaded; one that cannot be loaded, or
one past what the engines hold at once (--max-loras), is refused, naming why. (The base
model's parity with `vllm serve`, which runs without LoRA, is test_openai_parity's, on
these same LoRA-enabled meshes.)
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from support.cases import ADAPTERS, LORA_CASES, assert_answers_differ, openai_client

from prism.proto.stage.v1 import engine_pb2, engine_pb2_grpc


def ask(mesh, name: str, stream: bool = True) -> tuple[str, str, int]:
    """Case `name` of LORA_CASES, of its adapter (or the base model): the model the answer
    names, its text and its completion tokens."""
    _, messages, max_tokens, sampling = LORA_CASES[name]
    model = sampling["lora"] or mesh.model
    client = openai_client(mesh)
    params = dict(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        reply = client.chat.completions.create(**params)
        return reply.model, reply.choices[0].message.content, reply.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        **params, stream=True, stream_options={"include_usage": True}
    ))  # fmt: skip
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return chunks[0].model, text, chunks[-1].usage.completion_tokens


def test_each_adapter_answers_apart_from_the_base(oracle, mesh):
    # Guards the tests below against adapters that change nothing.
    expected = oracle(mesh.family)
    for i in range(6):
        answers = {expected[f"lora_{a}_{i}"]["text"] for a in ("base", *ADAPTERS)}
        assert len(answers) == 3, answers


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_an_adapters_image_chats_equal_offline_vllms_with_it(mesh, oracle, adapter, stream):
    expected = oracle(mesh.family)
    for i in range(2):
        name = f"lora_{adapter}_{i}"
        model, text, tokens = ask(mesh, name, stream)
        assert model == adapter
        assert (text, tokens) == (expected[name]["text"], len(expected[name]["token_ids"]))


def test_the_base_and_both_adapters_together_each_equal_offline_vllm(mesh, oracle):
    """18 image chats (6 prompts, each of the base model and of both adapters), 16 at a
    time: each answer is its own adapter's, so that an adapter applied to another's
    request, or KV shared across adapters, shows."""
    expected = oracle(mesh.family)
    assert_answers_differ(expected, LORA_CASES)
    with ThreadPoolExecutor(16) as pool:
        answers = dict(zip(LORA_CASES, pool.map(lambda name: ask(mesh, name), LORA_CASES),
                           strict=True))  # fmt: skip
    wrong = {
        name: (text, expected[name]["text"])
        for name, (_, text, tokens) in answers.items()
        if (text, tokens) != (expected[name]["text"], len(expected[name]["token_ids"]))
    }
    assert not wrong, wrong


def test_models_lists_each_adapter_with_the_base_as_its_parent(mesh, adapters):
    listed = httpx.get(f"{mesh.base_url}/models", timeout=30).json()["data"]
    by_id = {model["id"]: model for model in listed}
    assert by_id[mesh.model]["parent"] is None
    for name, path in adapters[mesh.family].items():
        assert by_id[name]["parent"] == mesh.model
        assert by_id[name]["root"] == str(path)


def test_an_adapter_the_mesh_does_not_hold_is_a_404_naming_it(mesh):
    body = {"model": "no-such-adapter", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    reply = httpx.post(f"{mesh.base_url}/chat/completions", json=body, timeout=30)
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert "no-such-adapter" in error["message"] and error["param"] == "model"
    # The mesh serves on.
    assert ask(mesh, "lora_a1_0")[0] == "a1"


def _post(mesh, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{mesh.base_url}/{path}", json=body, timeout=120)


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(mesh, oracle, adapters):
    """a2's files under another name and directory (where the mesh allows loading): its
    answers are a2's; a worker that does not hold it loads it from the request; unloaded,
    it is a 404."""
    source = adapters[mesh.family]["a2"]
    copy = source.parent / f"{mesh.family}-{mesh.mode.replace('/', '')}-b2"
    shutil.copytree(source, copy, dirs_exist_ok=True)
    load = {"lora_name": "b2", "lora_path": str(copy)}
    reply = _post(mesh, "load_lora_adapter", load)
    assert reply.status_code == 200, reply.text
    assert reply.text == "Success: LoRA adapter 'b2' added successfully."
    again = _post(mesh, "load_lora_adapter", load)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    # a1, a2 and b2 fill the engine's --max-loras 3 (support.meshes.LORA_FLAGS): a fourth
    # is refused naming the bound, and not served.
    full = _post(mesh, "load_lora_adapter", {"lora_name": "b3", "lora_path": str(copy)})
    assert full.status_code == 400, full.text
    message = full.json()["error"]["message"]
    assert "serves 3 adapters" in message and " replica with --max-loras 3" in message
    expected = oracle(mesh.family)["lora_a2_0"]
    client = openai_client(mesh)
    _, messages, max_tokens, _ = LORA_CASES["lora_a2_0"]

    def answer() -> str:
        reply = client.chat.completions.create(
            model="b2", messages=messages, max_tokens=max_tokens, temperature=0
        )
        return reply.choices[0].message.content

    assert answer() == expected["text"]
    listed = httpx.get(f"{mesh.base_url}/models", timeout=30).json()["data"]
    assert {m["id"]: m["parent"] for m in listed}["b2"] == mesh.model
    assert "b3" not in {m["id"] for m in listed}
    # An engine that lost it (as a restarted one would have) loads it from the request.
    for stage in mesh.engine_stages:
        stub = engine_pb2_grpc.EngineServiceStub(mesh.channel(stage))
        request = engine_pb2.EngineServiceUnloadAdapterRequest(name="b2")
        assert stub.UnloadAdapter(request, timeout=30).unloaded
    assert answer() == expected["text"]
    reply = _post(mesh, "unload_lora_adapter", {"lora_name": "b2"})
    assert reply.status_code == 200 and reply.text.endswith("removed successfully.")
    gone = _post(mesh, "chat/completions", {"model": "b2", "messages": messages, "max_tokens": 2})
    assert gone.status_code == 404
    assert _post(mesh, "unload_lora_adapter", {"lora_name": "b2"}).status_code == 404


def test_an_adapter_that_cannot_be_loaded_is_refused_naming_why(mesh, adapters, tmp_path):
    allowed = adapters[mesh.family]["a1"].parent
    corrupt = allowed / f"{mesh.family}-{mesh.mode.replace('/', '')}-corrupt"
    corrupt.mkdir(exist_ok=True)
    (corrupt / "adapter_config.json").write_text("{not json")
    refused = {
        "a path outside --allowed-lora-dirs": (str(tmp_path), "allowed-lora-dirs"),
        "a corrupt directory": (str(corrupt), "cannot be loaded"),
    }
    for why, (path, named) in refused.items():
        reply = _post(mesh, "load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert reply.status_code == 400, (why, reply.text)
        assert named in reply.json()["error"]["message"], (why, reply.text)
    missing = _post(mesh, "load_lora_adapter", {"lora_name": "bad"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
    # Nothing was served under that name, and the mesh serves on.
    assert "bad" not in {m["id"] for m in httpx.get(f"{mesh.base_url}/models").json()["data"]}
    assert ask(mesh, "lora_a1_0")[0] == "a1"
