"""The encoder stage and the E/PD mode: embeddings computed once, moved by NIXL, freed."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import grpc
import openai
import pytest
import torch
from conftest import CASES, data_url, image_part, png, user, wait_for
from prometheus_client.parser import text_string_to_metric_families

from prism import rpc
from prism.ports import free_port
from prism.rpc import PrismError
from prism.services.encoder import VisionEncoder
from prism.stage.v1 import encoder_pb2, encoder_pb2_grpc, engine_pb2, engine_pb2_grpc
from prism.transfer.nixl import NixlTransfer
from prism.v1 import common_pb2

POOL = "prism_nixl_pool_bytes_in_use"


class Encoder:
    """A standalone `prism encoder` process with its metrics port."""

    def __init__(self, model: str, lease_s: float):
        self.port, self.metrics_port = free_port(), free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prism.cli", "--log-level", "warning", "encoder",
             "--model", model, "--port", str(self.port), "--metrics-port",
             str(self.metrics_port), "--lease-s", str(lease_s), "--pool-mib", "16"],
        )  # fmt: skip
        assert wait_for(lambda: rpc.check_health(self.address), timeout=120), "encoder not up"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def encode(self, *images: bytes, request_id: str = "t") -> encoder_pb2.EncodeResponse:
        stub = encoder_pb2_grpc.EncoderServiceStub(rpc.sync_channel(self.address))
        request = encoder_pb2.EncodeRequest(
            request_id=request_id,
            images=[common_pb2.Image(data=data, mime_type="image/png") for data in images],
        )
        return stub.Encode(request, timeout=60)

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return sample.value
        raise KeyError(name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def encoder(models):
    running = Encoder(str(models["llava"]), lease_s=1.0)
    yield running
    running.stop()


def test_embeddings_read_over_nixl_equal_transformers(encoder, models):
    image = png(21)
    reply = encoder.encode(image, png(22))
    assert len(reply.embeddings.images) == 2
    reader = NixlTransfer(pool_bytes=8 * 2**20)
    try:
        tensors = [reader.fetch(handle.embeddings) for handle in reply.embeddings.images]
    finally:
        reader.close()
    expected = VisionEncoder(str(models["llava"])).encode([image, png(22)])
    for tensor, want in zip(tensors, expected, strict=True):
        assert tensor.shape == (16, 128) and torch.equal(tensor, want.tensor)
    # Both notifications arrived: the encoder freed both slices.
    assert wait_for(lambda: encoder.metric(POOL) == 0)


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
    assert wait_for(lambda: encoder.metric(POOL) == 0, timeout=15)
    assert encoder.metric("prism_nixl_reclaimed_total") >= reclaimed + 2


def test_encode_rejects_bad_images(encoder):
    stub = encoder_pb2_grpc.EncoderServiceStub(rpc.sync_channel(encoder.address))
    bad = encoder_pb2.EncodeRequest(images=[common_pb2.Image(data=b"<svg/>")])
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(bad, timeout=30)
    assert PrismError.from_rpc_error(info.value).http_status == 415
    with pytest.raises(grpc.RpcError) as info:
        stub.Encode(encoder_pb2.EncodeRequest(), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


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
        doomed.process.wait()
    prompt = engine_pb2.GenerateRequest(
        request_id="orphaned", prompt_token_ids=[5, 6],
        embeddings=encoder_pb2.MediaEmbeddings(images=handles),
        sampling=common_pb2.SamplingParams(max_tokens=2),
    )  # fmt: skip
    worker = engine_pb2_grpc.EngineServiceStub(rpc.sync_channel(mesh.worker))
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
