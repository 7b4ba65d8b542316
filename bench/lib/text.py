"""Prompt text for loads that need long, varied prompts (bench/routing.py, choices.py,
planner.py, planner_dynamo.py)."""

from __future__ import annotations

import functools
import random


@functools.cache
def vocabulary() -> list[str]:
    """The words of the tiny models' own corpus: about 1.3 tokens a word with their
    tokenizer. Read when first needed: its module loads torch, which a bench's pure parts
    (and their unit tests) do without."""
    from prism.devtools.tiny_models import CORPUS

    return sorted(set(CORPUS.split()))


def words(tag: str, count: int) -> str:
    """`count` words drawn by `tag`: the same tag, the same text."""
    draw = random.Random(tag)
    chosen = vocabulary()
    return " ".join(draw.choice(chosen) for _ in range(count))
