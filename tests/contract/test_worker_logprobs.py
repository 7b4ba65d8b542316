"""The worker's logprobs: vLLM's two forms of a position give one list (no processes)."""

from vllm.logprobs import FlatLogprobs

from prism.services.worker.servicer import engine_logprobs


def test_raw_and_merged_positions_give_the_same_list():
    raw = FlatLogprobs()
    # As the engine core lists them: the own token (rank 2), then the top 3, itself among.
    raw.append_fast([7, 5, 7, 9], [-1.0, -0.5, -1.0, -2.0], iter([2, 1, 2, 3]), iter([None] * 4))
    # Drawn at rank 4, outside the top 3.
    raw.append_fast([8, 5, 6, 9], [-3.0, -0.5, -1.0, -2.0], iter([4, 1, 2, 3]), iter([None] * 4))
    merged = FlatLogprobs()
    # What vLLM's output processor makes of it when it merges deltas: through dicts.
    merged.extend(list(raw))
    assert len(merged.token_ids) == 7
    for form in (raw, merged):
        first, second = engine_logprobs(form, 3)
        assert (list(first.token_ids), first.rank) == ([7, 5, 7, 9], 2)
        assert list(first.logprobs) == [-1.0, -0.5, -1.0, -2.0]
        assert (list(second.token_ids), second.rank) == ([8, 5, 6, 9], 4)


def test_no_logprobs_gives_none():
    assert engine_logprobs(None, 0) == []
    assert engine_logprobs([], 2) == []
