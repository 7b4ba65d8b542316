"""The encoder stage and the E/PD mode: embeddings computed once, moved by NIXL, freed."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
import torch
from safetensors import safe_open
from support import metrics
from support.cases import CASES
from support.content import data_url, image_part, png, user
from support.waiting import wait_for
from transformers import AutoConfig

from prism.devtools.presets import write_weights
from prism.proto.stage.v1 import encoder_pb2, encoder_pb2_grpc, engine_pb2, engine_pb2_grpc
from prism.proto.v1 import common_pb2
from prism.rpc.channel import check_health, sync_channel
from prism.rpc.errors import PrismError
from prism.runtime import processes
from prism.runtime.ports import free_port
from prism.services.encoder.towers import MediaEncoder
from prism.transfer.nixl import NixlTransfer

POOL = "prism_nixl_pool_bytes_in_use"


class Encoder:
    """A standalone `prism encoder` process with its metrics port."""

    def __init__(self, model: str, lease_s: float, *flags: str):
        self.port, self.metrics_port = free_port(), free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism.cli", "--log-level", "warning", "encoder",
             "--model", model, "--port", str(self.port), "--metrics-port",
             str(self.metrics_port), "--lease-s", str(lease_s), "--pool-mib", "16", *flags],
        )  # fmt: skip
        assert wait_for(lambda: check_health(self.address), timeout=120), "encoder not up"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def encode(self, *images: bytes, request_id: str = "t") -> encoder_pb2.EncodeResponse:
        stub = encoder_pb2_grpc.EncoderServiceStub(sync_channel(self.address))
        request = encoder_pb2.EncodeRequest(
            request_id=request_id,
            images=[common_pb2.Image(data=data, mime_type="image/png") for data in images],
        )
        return stub.Encode(request, timeout=60)

    def metric(self, name: str) -> float:
        """The sum of its samples called `name` (0 before the first is counted)."""
        return metrics.total(f"http://127.0.0.1:{self.metrics_port}/metrics", name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def encoder(models):
    # Short, for the reclaim test; long enough that a read right after encoding beats it
    # on a loaded machine (each read's agent is made before its encoding).
    running = Encoder(str(models["llava"]), lease_s=5.0)
    yield running
    running.stop()


def test_embeddings_read_over_nixl_equal_transformers(encoder, models):
    image = png(21)
    reclaimed = encoder.metric("prism_nixl_reclaimed_total")
    reader = NixlTransfer(pool_bytes=8 * 2**20)
    try:
        reply = encoder.encode(image, png(22))
        assert len(reply.embeddings.images) == 2
        tensors = [reader.fetch(handle.embeddings) for handle in reply.embeddings.images]
    finally:
        reader.close()
    expected = MediaEncoder(str(models["llava"])).encode([image, png(22)])
    for tensor, want in zip(tensors, expected, strict=True):
        assert tensor.shape == (16, 128) and torch.equal(tensor, want.tensor)
    # Both notifications arrived: the encoder freed both slices, not their lease.
    assert wait_for(lambda: encoder.metric(POOL) == 0)
    assert encoder.metric("prism_nixl_reclaimed_total") == reclaimed


def test_same_image_twice_hits_the_cache(encoder):
    hits = encoder.metric("prism_embedding_cache_hits_total")
    first = encoder.encode(png(23)).embeddings.images[0]
    second = encoder.encode(png(23)).embeddings.images[0]
    assert not first.cached and second.cached
    assert first.content_hash == second.content_hash
    assert encoder.metric("prism_embedding_cache_hits_total") == hits + 1


def test_unread_embeddings_are_reclaimed_after_the_lease(encoder):
    reclaimed = encoder.metric("prism_nixl_reclaimed_total")
    encoder.encode(png(24), png(25))
    assert encoder.metric(POOL) > 0
    assert wait_for(lambda: encoder.metric(POOL) == 0, timeout=30)
    assert encoder.metric("prism_nixl_reclaimed_total") >= reclaimed + 2


def test_encode_rejects_bad_images(encoder):
    stub = encoder_pb2_grpc.EncoderServiceStub(sync_channel(encoder.address))
    bad = encoder_pb2.EncodeRequest(images=[common_pb2.Image(data=b"<svg/>")])
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(bad, timeout=30)
    assert PrismError.from_rpc_error(info.value).http_status == 415
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(encoder_pb2.EncodeRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


PASSES = "prism_encoder_batch_items_count"
ITEMS = "prism_encoder_batch_items_sum"


@pytest.fixture(scope="module")
def batching_encoder(models):
    """An encoder whose batches close when 8 items are in, or after a second: time enough
    for the test's concurrent requests to arrive together, on any machine."""
    running = Encoder(str(models["llava"]), 5.0, "--batch-size", "8", "--batch-wait-ms", "1000")
    yield running
    running.stop()


def concurrently(encoder: Encoder, images: list[bytes]) -> list[encoder_pb2.EncodeResponse]:
    with ThreadPoolExecutor(len(images)) as pool:
        return list(pool.map(lambda i: encoder.encode(images[i], request_id=f"c{i}"),
                             range(len(images))))  # fmt: skip


def test_concurrent_requests_for_one_new_image_run_one_forward_pass(batching_encoder):
    passes = batching_encoder.metric(PASSES)
    replies = concurrently(batching_encoder, [png(71)] * 16)
    assert batching_encoder.metric(PASSES) == passes + 1
    (handle,) = {reply.embeddings.images[0].content_hash for reply in replies}
    assert handle
    # Each request got embeddings of its own to read, all of the one encoding.
    tags = {reply.embeddings.images[0].embeddings.nixl.notification_tag for reply in replies}
    assert len(tags) == 16


def test_concurrent_requests_for_distinct_images_share_forward_passes(batching_encoder, models):
    passes, items = batching_encoder.metric(PASSES), batching_encoder.metric(ITEMS)
    images = [png(80 + i) for i in range(8)]
    reader = NixlTransfer(pool_bytes=8 * 2**20)
    try:
        replies = concurrently(batching_encoder, images)
        # Batched, each image's embeddings are still its own.
        tensors = [reader.fetch(reply.embeddings.images[0].embeddings) for reply in replies]
    finally:
        reader.close()
    assert batching_encoder.metric(ITEMS) == items + 8
    assert batching_encoder.metric(PASSES) - passes < 8
    expected = MediaEncoder(str(models["llava"])).encode(images)
    for tensor, want in zip(tensors, expected, strict=True):
        assert torch.equal(tensor, want.tensor)


PEAK_MEMORY = """
import re, sys
from prism.services.encoder.towers import MediaEncoder

def peak_mib():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024

before = peak_mib()
MediaEncoder(sys.argv[1])
print(peak_mib() - before)
"""


def big_language_model(tiny: Path, out: Path) -> int:
    """The tiny LLaVA's vision tower and processor under a language model of ~400 MB saved
    in bfloat16; returns the bytes of its language model weights."""
    for source in tiny.iterdir():
        if source.name != "model.safetensors":
            shutil.copy(source, out / source.name)
    config = AutoConfig.from_pretrained(tiny)
    text = config.get_text_config()
    text.hidden_size, text.num_hidden_layers, text.intermediate_size = 1024, 12, 4096
    text.num_attention_heads = text.num_key_value_heads = 16
    config.dtype = "bfloat16"
    config.save_pretrained(out)
    write_weights(config, out)
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        shapes = [weights.get_slice(name).get_shape() for name in weights.keys()  # noqa: SIM118
                  if name.startswith("language_model.")]  # fmt: skip
    return sum(math.prod(shape) * 2 for shape in shapes)


def test_the_encoder_never_materializes_the_language_model(models, tmp_path):
    big = big_language_model(models["llava"], tmp_path)
    assert big > 400 * 10**6

    def growth(model: Path) -> int:
        result = subprocess.run([sys.executable, "-c", PEAK_MEMORY, str(model)],
                                capture_output=True, text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        return int(result.stdout.split()[-1])

    tiny = growth(models["llava"])
    # Loading the whole checkpoint would grow by the language model at least (twice over
    # in float32); the vision path alone, by what the tiny model takes.
    assert growth(tmp_path) - tiny < 100, (tiny, big)


def e_pd_only(mesh) -> None:
    if mesh.mode != "e/pd":
        pytest.skip("E/PD mode only")


def test_burst_leaves_the_pool_empty(mesh, oracle):
    e_pd_only(mesh)
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    fresh = data_url(png(31))
    hits = mesh.metrics("encoder")["prism_embedding_cache_hits_total"]
    for _ in range(4):
        reply = client.chat.completions.create(
            model=mesh.model, messages=user(image_part(fresh), "Describe."), max_tokens=4,
            temperature=0,
        )  # fmt: skip
        assert reply.usage.completion_tokens == 4
    assert mesh.metrics("encoder")["prism_embedding_cache_hits_total"] == hits + 3
    assert wait_for(lambda: mesh.metrics("encoder")[POOL] == 0)
    assert mesh.metrics("worker")["prism_nixl_bytes_read_total"] > 0


def test_worker_fails_cleanly_when_the_embeddings_owner_is_gone(mesh, models, oracle):
    e_pd_only(mesh)
    doomed = Encoder(str(models[mesh.family]), lease_s=30)
    try:
        handles = doomed.encode(png(41)).embeddings.images
    finally:
        doomed.process.kill()
        assert processes.reap(doomed.process)
    prompt = engine_pb2.GenerateRequest(
        request_id="orphaned", prompt_token_ids=[5, 6],
        embeddings=encoder_pb2.MediaEmbeddings(images=handles),
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )  # fmt: skip
    worker = engine_pb2_grpc.EngineServiceStub(sync_channel(mesh.worker))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        list(worker.Generate(prompt, timeout=60))
    assert time.monotonic() - started < 30
    error = PrismError.from_rpc_error(info.value)
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason_name == "EMBEDDINGS_UNAVAILABLE" and "embeddings" in error.message
    # The worker keeps serving.
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    _, messages, max_tokens = CASES["one_image"]
    reply = client.chat.completions.create(
        model=mesh.model, messages=messages, max_tokens=max_tokens, temperature=0
    )
    assert reply.choices[0].message.content == oracle(mesh.family)["one_image"]["text"]
