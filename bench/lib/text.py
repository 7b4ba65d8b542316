"""Prompt text for loads that need long, varied prompts (bench/routing.py, choices.py)."""

from __future__ import annotations

import random

from prism.devtools.tiny_models import CORPUS

# Text of the tiny models' own corpus: about 1.3 tokens a word with their tokenizer.
VOCABULARY = sorted(set(CORPUS.split()))


def words(tag: str, count: int) -> str:
    """`count` words drawn by `tag`: the same tag, the same text."""
    draw = random.Random(tag)
    return " ".join(draw.choice(VOCABULARY) for _ in range(count))
