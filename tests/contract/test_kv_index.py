"""The KV index against vLLM's own block pool: the events vLLM emits for a prompt it
cached, keyed by the worker and sent to the processor's index, make it hold exactly the
blocks that `prompt_keys` names for that prompt, with the media at the same places, and
nothing for other media or places."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from prism.engine.kv_events import changes
from prism.kv_index import EngineBlocks, KvIndex, MediaSpan, prompt_keys

BLOCK = 4
IMAGE_TOKEN = 99


@pytest.fixture(scope="module", autouse=True)
def _none_hash() -> None:
    init_none_hash(sha256)


def prompt(
    before: int, media: list[tuple[str, int]], after: int
) -> tuple[list[int], list[MediaSpan]]:
    """Token ids with each (identifier, tokens) item's placeholders, text between."""
    tokens = list(range(1, before + 1))
    spans = []
    for identifier, length in media:
        spans.append(MediaSpan(identifier, len(tokens), length))
        tokens += [IMAGE_TOKEN] * length + [7]
    return tokens + list(range(50, 50 + after)), spans


def cached_by_vllm(
    pool: BlockPool, tokens: list[int], spans: list[MediaSpan], adapter: str = ""
) -> list:
    """Has vLLM's block pool cache the prompt's full blocks (computed with the LoRA
    `adapter`, "" for none); its events."""
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=span.identifier,
            mm_position=PlaceholderRange(offset=span.offset, length=span.length),
        )
        for span in spans
    ]
    request = Request(
        f"r{len(tokens)}-{id(spans)}",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        mm_features=features,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
        lora_request=LoRARequest(adapter, 1, "/adapters/" + adapter) if adapter else None,
    )
    full = len(tokens) // BLOCK
    blocks = pool.get_new_blocks(full)
    pool.cache_full_blocks(request, blocks, 0, full, BLOCK, 0)
    pool.free_blocks(blocks)
    return pool.take_events()


class Workers:
    """Replicas' workers keying their engine's events (one EngineBlocks each) and the
    processor's index of what they send."""

    def __init__(self) -> None:
        self.index = KvIndex()
        self.blocks: dict[str, EngineBlocks] = {}

    def feed(self, replica: str, events: list) -> None:
        for change in changes(self.blocks.setdefault(replica, EngineBlocks()), events):
            self.index.receive(replica, change.snapshot, change.stored, change.removed)


def new_pool(blocks: int = 64) -> BlockPool:
    return BlockPool(
        blocks, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True
    )


def test_a_prompt_vllm_cached_is_held_whole_and_its_prefix_shared():
    workers = Workers()
    index = workers.index
    tokens, spans = prompt(5, [("cat", 6)], 9)
    workers.feed("a", cached_by_vllm(new_pool(), tokens, spans))
    keys = prompt_keys(tokens, spans, BLOCK)
    assert len(keys) == len(tokens) // BLOCK
    assert index.overlaps(keys, ["a", "b"]) == {"a": len(keys), "b": 0}
    assert index.size("a") == len(keys)
    # A longer prompt that starts the same way: the blocks they share are held.
    longer, longer_spans = prompt(5, [("cat", 6)], 30)
    assert index.overlaps(prompt_keys(longer, longer_spans, BLOCK), ["a"])["a"] == len(keys)
    # One that differs in its 15th token: its first three blocks.
    changed = [*tokens[:14], 1000, *tokens[15:]]
    assert index.overlaps(prompt_keys(changed, spans, BLOCK), ["a"])["a"] == 3


def test_a_different_image_at_the_same_place_never_matches():
    workers = Workers()
    index = workers.index
    tokens, spans = prompt(4, [("cat", 8)], 8)
    workers.feed("a", cached_by_vllm(new_pool(), tokens, spans))
    other, other_spans = prompt(4, [("dog", 8)], 8)
    assert other == tokens
    # The first block is text alone; from the image's first block on, nothing matches.
    assert index.overlaps(prompt_keys(other, other_spans, BLOCK), ["a"]) == {"a": 1}


def test_the_same_image_at_another_place_does_not_match_its_blocks():
    workers = Workers()
    index = workers.index
    tokens, spans = prompt(4, [("cat", 8)], 8)
    workers.feed("a", cached_by_vllm(new_pool(), tokens, spans))
    shifted, shifted_spans = prompt(6, [("cat", 8)], 6)
    assert index.overlaps(prompt_keys(shifted, shifted_spans, BLOCK), ["a"]) == {"a": 1}


def test_two_images_in_one_block_and_one_across_blocks_match_as_vllm_hashed_them():
    workers = Workers()
    index = workers.index
    tokens, spans = prompt(3, [("a", 1), ("b", 9), ("c", 2)], 5)
    workers.feed("x", cached_by_vllm(new_pool(), tokens, spans))
    keys = prompt_keys(tokens, spans, BLOCK)
    assert index.overlaps(keys, ["x"]) == {"x": len(keys)}
    swapped = [MediaSpan("c", spans[2].offset, 2) if s.identifier == "c" else s for s in spans]
    swapped[0] = MediaSpan("z", spans[0].offset, 1)
    assert index.overlaps(prompt_keys(tokens, swapped, BLOCK), ["x"]) == {"x": 0}


def test_blocks_cached_under_an_adapter_match_only_that_adapters_prompts():
    """vLLM keys an adapter's blocks by its name: the same image prompt under another
    adapter, or the base model, is no hit, and the adapter's own is a whole one."""
    workers = Workers()
    index = workers.index
    tokens, spans = prompt(5, [("cat", 6)], 9)
    workers.feed("a", cached_by_vllm(new_pool(), tokens, spans, adapter="a1"))
    workers.feed("b", cached_by_vllm(new_pool(), tokens, spans))
    under = {adapter: prompt_keys(tokens, spans, BLOCK, adapter) for adapter in ("", "a1", "a2")}
    assert index.overlaps(under["a1"], ["a", "b"]) == {"a": len(under["a1"]), "b": 0}
    assert index.overlaps(under[""], ["a", "b"]) == {"a": 0, "b": len(under[""])}
    assert index.overlaps(under["a2"], ["a", "b"]) == {"a": 0, "b": 0}


def test_evicted_blocks_leave_the_index_and_a_cleared_replica_holds_nothing():
    workers = Workers()
    index = workers.index
    pool = new_pool(blocks=5)  # Room for four blocks: the next prompt evicts the first.
    first, first_spans = prompt(8, [], 8)
    workers.feed("a", cached_by_vllm(pool, first, first_spans))
    workers.feed("b", cached_by_vllm(new_pool(), first, first_spans))
    first_keys = prompt_keys(first, first_spans, BLOCK)
    second = [t + 1000 for t in first]
    workers.feed("a", cached_by_vllm(pool, second, []))
    assert index.overlaps(first_keys, ["a", "b"]) == {"a": 0, "b": 4}
    assert index.overlaps(prompt_keys(second, [], BLOCK), ["a", "b"]) == {"a": 4, "b": 0}
    assert pool.reset_prefix_cache()
    workers.feed("a", pool.take_events())
    assert index.size("a") == 0 and index.size("b") == 4
    index.drop("b")
    assert index.overlaps(first_keys, ["a", "b"]) == {"a": 0, "b": 0}


def test_blocks_after_a_parent_not_held_are_left_out():
    blocks = EngineBlocks()
    assert blocks.stored([b"h2"], b"h1", [1, 2, 3, 4], BLOCK, []) == []
    assert blocks.orphans == 1 and blocks.keys() == []
