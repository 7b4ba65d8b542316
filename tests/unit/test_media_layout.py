"""`lay_out` on its own: where a prompt's media items lie (tests/e2e/test_layout_as_vllm.py
holds it to vLLM's own multimodal processor)."""

from __future__ import annotations

from prism.kv_index import MediaSpan, lay_out


def test_the_prompt_ends_before_an_item_whose_tokens_are_unknown():
    tokens, spans = lay_out([1, 2, 9, 3, 8, 4], {8, 9}, {9: [("a", 3)]})
    assert (tokens, spans) == ([1, 2, 9, 9, 9, 3], [MediaSpan("a", 2, 3)])
    assert lay_out([1, 9, 2, 9, 3], {9}, {9: [("a", 2)]}) == ([1, 9, 9, 2], [MediaSpan("a", 1, 2)])
