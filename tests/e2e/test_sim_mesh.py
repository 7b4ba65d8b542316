"""A mesh on simulated workers (`prism serve --engine sim`): real gateway and processor
processes before engines without a model. Their KV events feed `kv` routing as vLLM's do
(each next turn goes where its start is cached, its image's blocks included), and a
bounded burst of streams completes with nothing left in flight. Both hold whether each
engine is its own process or both run in one (`--sim-engines 2`), each its own replica."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
from support.content import data_url, image_part, png, user
from support.meshes import start_mesh, stream_outcome
from support.waiting import wait_for


@pytest.fixture(scope="module", params=[1, 2], ids=["process-each", "one-process"])
def sim_mesh(request, models, tmp_path_factory):
    mesh = start_mesh("llava", "epd", models["llava"], tmp_path_factory.mktemp("sim"),
                      workers=2, routing="kv", engine="sim", sim_engines=request.param)  # fmt: skip
    try:
        replicas = [a for name in mesh.engine_stages for a in mesh.mesh.stage(name).replicas]
        assert len(mesh.engine_stages) == 2 // request.param and len(set(replicas)) == 2
        # Until the processor follows both engines' caches.
        assert wait_for(lambda: all(
            mesh.metric("front", "prism_kv_snapshots_total", replica=replica)
            for replica in replicas
        ))  # fmt: skip
        yield mesh
    finally:
        mesh.stop()


def total(mesh, name: str) -> float:
    """`name` summed over the engine processes: each counts all of its engines."""
    return sum(mesh.metric(stage, name) for stage in mesh.engine_stages)


def test_each_next_turn_is_sent_where_its_start_is_cached(sim_mesh):
    client = openai.OpenAI(base_url=sim_mesh.base_url, api_key="unused", max_retries=0)
    long = " ".join(f"word{i}" for i in range(60))
    for turn in range(6):
        first = user(image_part(data_url(png(300 + turn))), f"Conversation {turn}: {long}")
        answer = client.chat.completions.create(model=sim_mesh.model, messages=first,
                                                max_tokens=4, temperature=0)  # fmt: skip
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        follow = [*first, {"role": "assistant", "content": answer.choices[0].message.content},
                  *user("And then?")]  # fmt: skip
        again = client.chat.completions.create(model=sim_mesh.model, messages=follow,
                                               max_tokens=4, temperature=0)  # fmt: skip
        # Round-robin would send every second one to the worker that has none of it.
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached >= answer.usage.prompt_tokens // 2, (turn, cached)


def test_a_burst_of_streams_completes_and_leaves_nothing_in_flight(sim_mesh):
    body = {"model": sim_mesh.model, "max_tokens": 48,
            "messages": user(image_part(data_url(png(9))), "Describe it.")}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(lambda _: stream_outcome(sim_mesh.base_url, body), range(256)))
    assert outcomes == ["completed"] * 256, sim_mesh.log_problems()
    assert wait_for(lambda: total(sim_mesh, "prism_engine_requests_in_flight") == 0)
    assert total(sim_mesh, "prism_sim_kv_blocks_used") == 0
