"""`--routing kv` on two aggregated workers behind two encoders (E/PD): each conversation's
next turn goes to the worker whose prefix cache holds its start, its image's blocks
included, so the engine serves those blocks from its cache; another image in the same place
matches nothing past it; each LoRA adapter's requests go to the worker that owns it, and a
prompt cached under one adapter is no hit for another or for the base; a processor started
again learns both caches from their snapshots; each image is encoded once, by the encoder
that owns it; a worker that dies leaves the processor's index and the rest serve on."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import openai
import pytest
from support.cases import ADAPTERS, laid_out
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh
from support.waiting import wait_for

from prism.media.modality import content_hash
from prism.proto.stage.v1 import kv_events_pb2, kv_events_pb2_grpc
from prism.registry import StaticRegistry
from prism.routing import Router

WORKERS = ["worker-0", "worker-1"]
ENCODERS = ["encoder-0", "encoder-1"]


@pytest.fixture(scope="module")
def kv_mesh(models, adapters, tmp_path_factory):
    served_adapters = [f"{name}={path}" for name, path in adapters["llava"].items()]
    mesh = start_mesh("llava", "e/pd", models["llava"], tmp_path_factory.mktemp("kv"),
                      workers=2, encoders=2, routing="kv",
                      lora_modules=served_adapters)  # fmt: skip
    try:
        # The mesh serves once one worker does: until the processor follows both workers'
        # caches and routes to both (a prompt shorter than a block is routed by load alone).
        client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
        assert wait_for(lambda: all(
            mesh.metric("front", "prism_kv_snapshots_total", replica=mesh.address(w))
            for w in WORKERS
        ))  # fmt: skip
        assert wait_for(lambda: client.completions.create(
            model=mesh.model, prompt=[5, 6, 7], max_tokens=1
        ) and all(served(mesh, w) for w in WORKERS))  # fmt: skip
        yield mesh
    finally:
        mesh.stop()


def served(mesh, worker: str) -> float:
    """Requests the engine of `worker` has finished."""
    return mesh.metric(worker, "vllm:request_success_total")


def block_size(mesh) -> int:
    stub = kv_events_pb2_grpc.KvEventsServiceStub(mesh.channel(WORKERS[0]))
    call = stub.Subscribe(kv_events_pb2.SubscribeRequest(), timeout=30)
    try:
        return next(call).block_size
    finally:
        call.cancel()


def index_blocks(mesh, worker: str) -> float:
    address = mesh.address(worker)
    return mesh.metric("front", "prism_kv_index_blocks", replica=address)


def test_each_next_turn_finds_its_start_in_the_cache_it_was_sent_to(kv_mesh):
    size = block_size(kv_mesh)
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    # Five: an odd number, so that round-robin would send each next turn to the other worker.
    conversations = [[100 + c * 97 + (i * 13) % 400 for i in range(3 * size)] for c in range(5)]
    for turn in range(3):
        for c, start in enumerate(conversations):
            prompt = [*start, 1000 + c, 1100 + turn]
            reply = client.completions.create(model=kv_mesh.model, prompt=prompt, max_tokens=2)
            if turn:
                # Its start's three blocks, held by the worker it went to the first time.
                assert reply.usage.prompt_tokens_details.cached_tokens >= 3 * size
        # The processor learns what the workers cached from their events, not at once.
        assert wait_for(
            lambda: sum(index_blocks(kv_mesh, w) for w in WORKERS) >= 3 * len(conversations)
        )
    # The conversations spread over both workers (each new one goes where load is least).
    assert all(index_blocks(kv_mesh, w) >= 3 for w in WORKERS)
    assert kv_mesh.metric("front", "prism_routing_decisions_total", policy="kv") >= 15


# A system prompt shared by every conversation, shorter than a block: a conversation's
# first block holds its image, so no two conversations share a block.
SYSTEM = " ".join(f"rule{i}" for i in range(10))


def image_turns(c: int, image: bytes) -> list[list[dict]]:
    """Conversation `c`'s messages at each of two turns: its image and question, then a
    follow-up after the answer."""
    first = [
        {"role": "system", "content": SYSTEM},
        *user(image_part(data_url(image)), " ".join(f"ask{c}x{i}" for i in range(50))),
    ]
    follow = [*first, {"role": "assistant", "content": "It is red."}, *user("And then?")]
    return [first, follow]


def test_a_conversations_image_blocks_are_found_where_they_were_cached(kv_mesh):
    size = block_size(kv_mesh)
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    images = [png(seed=200 + c, size=(64, 48)) for c in range(5)]
    conversations = [image_turns(c, image) for c, image in enumerate(images)]
    tokens, spans = laid_out(kv_mesh.model, conversations[0][0], images[:1])
    # The image lies in the first block, and the question fills another.
    assert spans[0].offset + spans[0].length <= size < 2 * size <= len(tokens)
    before = {w: served(kv_mesh, w) for w in WORKERS}
    for turn in range(2):
        for c, messages in enumerate(conversations):
            reply = client.chat.completions.create(
                model=kv_mesh.model, messages=messages[turn], max_tokens=2
            )
            if turn:
                # Held only by the worker its first turn went to: the keys of its blocks
                # are known only through its image's.
                assert reply.usage.prompt_tokens_details.cached_tokens >= 2 * size, c
        if not turn:
            # New images: no worker holds any of them, so they go to either in turn.
            assert all(served(kv_mesh, w) > before[w] for w in WORKERS)
        assert wait_for(
            lambda: sum(index_blocks(kv_mesh, w) for w in WORKERS) >= 2 * len(conversations)
        )
    # Another image in the same place: the blocks from it on match nothing.
    other = image_turns(0, png(seed=299, size=(64, 48)))[0]
    reply = client.chat.completions.create(model=kv_mesh.model, messages=other, max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_an_image_prompt_cached_under_one_adapter_is_no_hit_for_another_or_the_base(kv_mesh):
    """Each adapter's requests go to the engine that owns it, which alone loads it; the
    same image chat is a cache hit under the same adapter only: the routing keys, like
    vLLM's prefix cache, are the adapter's."""
    size = block_size(kv_mesh)
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    messages = image_turns(7, png(seed=350, size=(64, 48)))[0]
    addresses = {kv_mesh.address(w): w for w in WORKERS}
    owners = {a: addresses[Router(StaticRegistry({"worker": list(addresses)}), "kv").pick(
        "worker", adapter=a)] for a in ADAPTERS}  # fmt: skip

    def cached(model: str) -> int:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert reply.model == model
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached("a1") == 0
    assert cached("a1") >= 2 * size
    assert cached("a2") == 0
    assert cached(kv_mesh.model) == 0
    assert cached("a2") >= 2 * size
    for adapter in ADAPTERS:
        held = {w: kv_mesh.metric(w, "prism_engine_lora_adapters", adapter=adapter)
                for w in WORKERS}  # fmt: skip
        assert held == {w: float(w == owners[adapter]) for w in WORKERS}, (adapter, held)
        tokens = kv_mesh.metric("front", "prism_lora_tokens_total", adapter=adapter,
                                kind="completion")  # fmt: skip
        assert tokens == 4, adapter


def test_a_processor_restarted_mid_traffic_learns_both_caches_from_their_snapshots(kv_mesh):
    size = block_size(kv_mesh)
    assert all(index_blocks(kv_mesh, w) for w in WORKERS)
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    stop = threading.Event()
    answered = []

    def traffic() -> None:
        # Prompts of two blocks each, new to both caches, before, during and after.
        n = 0
        while not stop.is_set():
            prompt = [(7 * n + i) % 1400 + 50 for i in range(2 * size + 1)]
            n += 1
            with contextlib.suppress(openai.APIError):
                client.completions.create(model=kv_mesh.model, prompt=prompt, max_tokens=1)
                answered.append(n)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        assert wait_for(lambda: len(answered) >= 2)
        with open(kv_mesh.log_path, "a") as log:
            kv_mesh.mesh.restart("front", log=log)
        restarted = len(answered)
        assert wait_for(lambda: len(answered) >= restarted + 4)
    finally:
        stop.set()
        thread.join(timeout=60)
    # Its snapshots and the changes since: the index holds what each worker holds.
    assert wait_for(lambda: all(
        index_blocks(kv_mesh, w) == kv_mesh.metric(w, "prism_kv_blocks_held") for w in WORKERS
    ))  # fmt: skip
    # Each conversation's next turn finds its blocks, which it learned of only from them.
    for c in range(5):
        follow = image_turns(c, png(seed=200 + c, size=(64, 48)))[1]
        reply = client.chat.completions.create(model=kv_mesh.model, messages=follow, max_tokens=2)
        assert reply.usage.prompt_tokens_details.cached_tokens >= 2 * size, c


def test_each_image_is_encoded_once_by_the_encoder_that_owns_it(kv_mesh):
    addresses = {kv_mesh.address(e): e for e in ENCODERS}
    router = Router(StaticRegistry({"encoder": list(addresses)}), "kv")
    # Images until each encoder owns one (their owners follow the encoders' ports).
    images: list[bytes] = []
    owned = dict.fromkeys(ENCODERS, 0)
    while len(images) < 3 or not all(owned.values()):
        images.append(png(seed=400 + len(images), size=(64, 48)))
        owned[addresses[router.owner("encoder", content_hash(images[-1]))]] += 1
    before = {e: kv_mesh.metrics(e) for e in ENCODERS}
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    # Four times over, in turn: round-robin would send an image to both encoders.
    for _ in range(4):
        for image in images:
            messages = user(image_part(data_url(image)), "What is it?")
            client.chat.completions.create(model=kv_mesh.model, messages=messages, max_tokens=1)
    for encoder in ENCODERS:
        grown = [
            kv_mesh.metric(encoder, name) - before[encoder].get(name, 0)
            for name in ("prism_embedding_cache_misses_total", "prism_embedding_cache_hits_total")
        ]
        assert grown == [owned[encoder], 3 * owned[encoder]], encoder


def test_a_worker_that_dies_leaves_the_index_and_the_other_serves(kv_mesh):
    size = block_size(kv_mesh)
    client = openai.OpenAI(base_url=kv_mesh.base_url, api_key="unused", max_retries=0)
    # Prompts that match no cache go to each worker in turn: until worker-1 holds blocks.
    for n in range(8):
        prompt = [300 + 7 * n + i % 50 for i in range(2 * size)]
        client.completions.create(model=kv_mesh.model, prompt=prompt, max_tokens=1)
        if wait_for(lambda: index_blocks(kv_mesh, "worker-1") > 0, timeout=2):
            break
    assert wait_for(lambda: index_blocks(kv_mesh, "worker-1") > 0)
    os.killpg(kv_mesh.mesh.stage("worker-1").process.pid, signal.SIGKILL)
    assert wait_for(lambda: index_blocks(kv_mesh, "worker-1") == 0)
    for i in range(4):
        reply = client.completions.create(model=kv_mesh.model, prompt=f"Count {i}", max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
