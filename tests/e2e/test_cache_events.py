"""Every worker that prefills tells what its prefix cache holds (KvEventsService): a
prompt it ran is there, block by block, under the keys the processor computes for it (an
image's blocks too, named by its content hash), and the second time the engine serves
those blocks from its cache."""

from __future__ import annotations

import threading

import grpc
import openai
import pytest
from support.cases import laid_out
from support.content import data_url, image_part, png, user
from support.waiting import wait_for

from prism.kv_index import prompt_keys
from prism.proto.stage.v1 import kv_events_pb2, kv_events_pb2_grpc


class Subscription:
    """What a worker's KV events stream has said so far."""

    def __init__(self, channel: grpc.Channel) -> None:
        stub = kv_events_pb2_grpc.KvEventsServiceStub(channel)
        self.call = stub.Subscribe(kv_events_pb2.SubscribeRequest())
        self.held: set[int] = set()
        self.block_size = 0
        self.snapshots = 0
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                if message.snapshot:
                    self.held.clear()
                    self.snapshots += 1
                self.held.difference_update(message.removed)
                self.held.update(message.stored)
                self.block_size = message.block_size
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.call.cancel()
        self._thread.join(timeout=10)


@pytest.fixture
def subscriptions(mesh):
    """A subscription to each worker that prefills, once each has sent its snapshot."""
    stages = [s for s in mesh.engine_stages if not s.startswith("decode")]
    subscriptions = [Subscription(mesh.channel(stage)) for stage in stages]
    try:
        assert wait_for(lambda: all(s.snapshots for s in subscriptions))
        assert subscriptions[0].block_size > 0
        yield subscriptions
    finally:
        for subscription in subscriptions:
            subscription.close()


def test_a_prompt_run_is_held_under_its_keys_and_served_from_the_cache_again(mesh, subscriptions):
    block_size = subscriptions[0].block_size
    # Two full blocks and a part; token ids no other test sends.
    prompt = [1000 + (i * 7) % 500 for i in range(2 * block_size + 3)]
    keys = prompt_keys(prompt, [], block_size)
    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    first = client.completions.create(model=mesh.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == len(prompt)
    # The engine that ran it (of the role's replicas) holds its full blocks.
    assert wait_for(lambda: any(set(keys) <= s.held for s in subscriptions))
    again = client.completions.create(model=mesh.model, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == len(keys) * block_size


def test_an_images_blocks_are_held_under_the_keys_of_its_content(mesh, subscriptions):
    block_size = subscriptions[0].block_size
    text = " ".join(f"cache{i}" for i in range(block_size))
    image = png(seed=931, size=(64, 48))  # a seed of its own: no other test sends it
    messages = user(text, image_part(data_url(image)), text)
    tokens, spans = laid_out(mesh.model, messages, [image])
    keys = prompt_keys(tokens, spans, block_size)
    # The image lies in a full block.
    assert spans[0].offset + spans[0].length <= len(keys) * block_size

    client = openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)
    first = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == len(tokens)
    assert wait_for(lambda: any(set(keys) <= s.held for s in subscriptions))
    again = client.chat.completions.create(model=mesh.model, messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == len(keys) * block_size


def test_decode_workers_serve_no_kv_events(mesh):
    decodes = [s for s in mesh.engine_stages if s.startswith("decode")]
    if not decodes:
        pytest.skip("no decode worker in this mode")
    stub = kv_events_pb2_grpc.KvEventsServiceStub(mesh.channel(decodes[0]))
    with pytest.raises(grpc.RpcError) as error:
        next(stub.Subscribe(kv_events_pb2.SubscribeRequest(), timeout=10))
    assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
