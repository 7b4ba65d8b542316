"""Prometheus metrics of a running mesh move by exactly what the requests did."""

from __future__ import annotations

import openai
from support.content import data_url, png, user
from support.meshes import ENGINE_MAX_NUM_SEQS
from support.waiting import wait_for

from prism.modes import MODES

CHAT = "/v1/chat/completions"


def test_metrics_follow_the_requests(mesh):
    stages = ["front"]
    roles = MODES[mesh.mode].roles
    reader = {"e/pd": "worker", "e/p/d": "prefill"}.get(mesh.mode)
    if "encoder" in roles:
        stages.append("encoder")
    if reader:
        stages.append(reader)
    before = {stage: mesh.metrics(stage) for stage in stages}
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    # The same image twice: the second time the encoder has it cached.
    messages = user("What is this?", {"type": "image_url",
                                      "image_url": {"url": data_url(png(61))}})  # fmt: skip
    whole = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=6, temperature=0
    )
    chunks = list(client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    usages = [whole.usage, chunks[-1].usage]
    completion = sum(u.completion_tokens for u in usages)
    prompt = sum(u.prompt_tokens for u in usages)

    def grown(stage: str, name: str) -> float:
        return mesh.metrics(stage).get(name, 0.0) - before[stage].get(name, 0.0)

    # The front serves both: the REST endpoint and the processor's RPC, each its own labels.
    for stage, endpoint, ok in (("front", CHAT, "200"), ("front", "Chat", "OK")):
        labels = f'{{endpoint="{endpoint}"}}'
        # A request is counted once its handler has ended, which may be a moment after the
        # client has read the stream's last event.
        counted = f'prism_requests_total{{endpoint="{endpoint}",status="{ok}"}}'
        assert wait_for(lambda: grown(stage, counted) >= 2)  # noqa: B023
        assert grown(stage, counted) == 2
        assert grown(stage, f"prism_completion_tokens_total{labels}") == completion
        assert grown(stage, f"prism_prompt_tokens_total{labels}") == prompt
        assert grown(stage, f"prism_time_to_first_token_seconds_count{labels}") == 2
        assert grown(stage, f"prism_request_duration_seconds_count{labels}") == 2
        # One gap per token after each request's first reply. That reply holds at least one
        # token, and more as the engine gets ahead of its reader, which only timing decides
        # (test_observability counts a reply of several tokens exactly).
        between = grown(stage, f"prism_inter_token_latency_seconds_count{labels}")
        assert between <= completion - 2
        assert mesh.metrics(stage)[f"prism_requests_in_flight{labels}"] == 0
        assert mesh.metrics(stage)[f"prism_requests_waiting{labels}"] == 0
    if "encoder" in roles:
        assert grown("encoder", "prism_embedding_cache_misses_total") == 1
        assert grown("encoder", "prism_embedding_cache_hits_total") == 1
        assert mesh.metrics("encoder")["prism_embedding_cache_bytes"] > 0
    if reader:
        assert grown(reader, 'prism_nixl_read_seconds_count{tensor="embeddings"}') == 2
        assert grown(reader, "prism_nixl_bytes_read_total") > 0
        # Read slices go back to the pool.
        assert wait_for(lambda: mesh.metrics(reader)["prism_nixl_pool_bytes_in_use"] == 0)
    for engine in ("worker", "prefill", "decode"):
        if engine in roles:
            assert mesh.metrics(engine)["prism_engine_requests_in_flight"] == 0


def test_engines_run_with_the_vllm_arguments_passed_through(mesh):
    """`prism serve --max-num-seqs N` reaches every vLLM engine, as the running engine
    holds it; the CPU backend runs eagerly, as nothing asked otherwise."""
    roles = MODES[mesh.mode].roles
    for engine in ("worker", "prefill", "decode"):
        if engine in roles:
            (config,) = [key for key in mesh.metrics(engine)
                         if key.startswith("prism_engine_config_info{")]  # fmt: skip
            assert f'max_num_seqs="{ENGINE_MAX_NUM_SEQS}"' in config
            assert 'enforce_eager="True"' in config
            assert 'device="cpu"' in config
            assert 'embeddings_device="cpu"' in config
