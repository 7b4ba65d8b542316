"""The simulated engine's scheduling and prefix cache, in process: batching limits, prefix
reuse and its events, eviction, preemption, prefill holds, aborts, and every block back
in the pool at the end."""

from __future__ import annotations

import asyncio

import pytest

from prism.config.sim import SimConfig
from prism.services.sim.engine import BlockPool, Output, Seq, SimEngine

BLOCK = 4
FAST = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=BLOCK)


def seq(name: str, prompt: int, keys: list[int] | None = None, tokens: int = 3, **kw) -> Seq:
    return Seq(name, prompt, keys if keys is not None else [], tokens, seed=name, **kw)


async def run(engine: SimEngine, *seqs: Seq) -> list[list[Output]]:
    async def one(s: Seq) -> list[Output]:
        return [output async for output in engine.generate(s)]

    return await asyncio.gather(*(one(s) for s in seqs))


def with_engine(config: SimConfig, test) -> tuple[SimEngine, list[tuple[list[int], list[int]]]]:
    events: list[tuple[list[int], list[int]]] = []

    async def main() -> SimEngine:
        engine = SimEngine(config, lambda stored, removed: events.append((stored, removed)))
        engine.start()
        try:
            await test(engine)
        finally:
            await engine.stop()
        return engine

    return asyncio.run(main()), events


def test_a_sequence_streams_its_tokens_then_its_end_and_gives_its_blocks_back():
    async def test(engine: SimEngine) -> None:
        (outputs,) = await run(engine, seq("a", 10, tokens=5))
        # The last token and the end are ready together: they leave together, as vLLM's.
        assert [len(o.token_ids) for o in outputs] == [1] * 5
        assert outputs[0].first and outputs[0].prompt_tokens == 10
        assert outputs[-1].finish == "length" and not any(o.finish for o in outputs[:-1])
        # One step computes the prompt and draws the first token; each other, one token.
        assert engine.steps == 5
        assert engine.pool.used() == 0 and not engine.running and not engine.waiting

    with_engine(FAST, test)


@pytest.mark.parametrize("requested,engine_wide", [(3, 1), (0, 3), (2, 3)])
def test_a_stream_interval_sends_the_first_token_alone_then_that_many_a_reply(
    requested, engine_wide
):
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=BLOCK,
                       stream_interval=engine_wide)  # fmt: skip

    async def test(engine: SimEngine) -> None:
        (outputs,) = await run(engine, seq("a", 10, tokens=8, stream_interval=requested))
        # The larger of the two applies, as in vLLM.
        assert [len(o.token_ids) for o in outputs] == [1, 3, 3, 1]
        assert outputs[0].first and outputs[-1].finish == "length"
        tokens = [t for o in outputs for t in o.token_ids]
        assert tokens == [seq("a", 10).token(i) for i in range(8)]

    with_engine(config, test)


def test_tokens_follow_the_seed_so_a_decode_draws_what_its_prefill_drew():
    a, b, c = Seq("x", 4, [], 8, seed="7"), Seq("y", 4, [], 8, seed="7"), Seq("z", 4, [], 8, "8")
    assert [a.token(i) for i in range(8)] == [b.token(i) for i in range(8)]
    assert [a.token(i) for i in range(8)] != [c.token(i) for i in range(8)]


def test_a_prompt_that_starts_the_same_way_reuses_the_cached_blocks():
    keys = [11, 12, 13]

    async def test(engine: SimEngine) -> None:
        (first,) = await run(engine, seq("a", 13, keys))
        assert first[0].cached_tokens == 0
        (again,) = await run(engine, seq("b", 13, keys))
        assert again[0].cached_tokens == 3 * BLOCK
        # A prompt of exactly its blocks still computes its last token.
        (whole,) = await run(engine, seq("c", 12, keys))
        assert whole[0].cached_tokens == 2 * BLOCK
        (other,) = await run(engine, seq("d", 13, [11, 99, 98]))
        assert other[0].cached_tokens == BLOCK

    _, events = with_engine(FAST, test)
    stored = [key for added, _ in events for key in added]
    assert stored == [11, 12, 13, 99, 98]


def test_blocks_run_out_evict_the_least_recently_used_prompt():
    # Room for a prompt of three blocks and its answer, and two blocks more.
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=BLOCK,
                       num_blocks=6)  # fmt: skip

    async def test(engine: SimEngine) -> None:
        await run(engine, seq("a", 12, [1, 2, 3], tokens=2))
        await run(engine, seq("b", 12, [4, 5, 6], tokens=2))
        # b needs four blocks where three are free: a's first block goes, and no other.
        assert sorted(engine.pool.keys()) == [2, 3, 4, 5, 6]

    _, events = with_engine(config, test)
    assert [key for _, gone in events for key in gone] == [1]


def test_no_more_sequences_run_at_once_than_the_limit():
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.001, block_size=BLOCK,
                       max_num_seqs=2)  # fmt: skip
    most = 0

    async def test(engine: SimEngine) -> None:
        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, len(engine.running))
                await asyncio.sleep(0.0002)

        watcher = asyncio.create_task(watch())
        outputs = await run(engine, *(seq(f"s{i}", 5, tokens=4) for i in range(5)))
        watcher.cancel()
        assert all(sum(len(x.token_ids) for x in o) == 4 and o[-1].finish for o in outputs)

    with_engine(config, test)
    assert most == 2


def test_a_step_takes_its_prompt_tokens_within_the_token_budget():
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=BLOCK,
                       max_num_batched_tokens=8)  # fmt: skip

    async def test(engine: SimEngine) -> None:
        (outputs,) = await run(engine, seq("long", 30, tokens=1))
        assert outputs[0].prompt_tokens == 30
        # 30 prompt tokens at 8 a step: four steps, the last of which gives the token.
        assert engine.steps == 4

    with_engine(config, test)


def test_a_decode_without_a_free_block_preempts_the_newest_which_still_finishes():
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.0005, block_size=BLOCK,
                       num_blocks=5)  # fmt: skip

    async def test(engine: SimEngine) -> None:
        # Each needs 2 blocks to start and 4 by its end: both cannot hold theirs at once.
        outputs = await run(engine, seq("a", 6, tokens=9), seq("b", 6, tokens=9))
        assert [sum(len(o.token_ids) for o in out) for out in outputs] == [9, 9]
        assert engine.preemptions >= 1
        assert outputs[1][0].token_ids == [Seq("b", 6, [], 9, "b").token(0)]
        assert engine.pool.used() == 0

    with_engine(config, test)


def test_a_prefill_holds_its_blocks_until_released():
    async def test(engine: SimEngine) -> None:
        (outputs,) = await run(engine, seq("p", 10, [1, 2], tokens=1, hold=True))
        assert outputs[-1].finish == "length"
        assert engine.pool.used() == 3 and "p" in engine.held
        assert engine.release("p") and not engine.release("p")
        assert engine.pool.used() == 0

    with_engine(FAST, test)


def test_a_caller_that_stops_reading_aborts_and_frees_the_blocks():
    config = SimConfig(prefill_tokens_per_s=1e6, decode_step_s=0.002, block_size=BLOCK)

    async def test(engine: SimEngine) -> None:
        stream = engine.generate(seq("a", 10, tokens=1000))
        await anext(stream)
        assert engine.pool.used() > 0
        await stream.aclose()
        assert engine.pool.used() == 0 and not engine.running
        (outputs,) = await run(engine, seq("b", 10, tokens=2))
        assert outputs[-1].finish == "length"

    with_engine(config, test)


def test_a_prompt_too_long_for_the_model_is_refused():
    async def test(engine: SimEngine) -> None:
        with pytest.raises(ValueError, match="leaves no room"):
            await run(engine, seq("a", FAST.max_model_len))

    with_engine(FAST, test)


def test_the_pool_counts_shared_blocks_once():
    events: list = []
    pool = BlockPool(4, lambda stored, removed: events.append((stored, removed)))
    assert pool.take([], 2)
    assert pool.cache([7, 8]) == [7, 8]
    assert pool.take([7, 8], 1) and pool.used() == 3
    assert not pool.take([], 2)
    pool.give_back([7, 8], 0)
    pool.give_back([7, 8], 1)
    assert pool.used() == 0 and pool.available() == 4
    pool.clear()
    assert events == [([7, 8], []), ([], [7, 8])]
