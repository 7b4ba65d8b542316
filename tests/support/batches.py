"""Batch input lines of the concurrent cases (tests/support/cases.py), as the Batch API's
tests and `prism run-batch`'s write them, and a batch file's entries read back."""

from __future__ import annotations

import json
from typing import Any

from support.cases import CONCURRENT_CASES

# Chats of the concurrent cases (every other one with an image), and their completions.
CHATS = [name for name, case in CONCURRENT_CASES.items() if case[0] == "chat"]
COMPLETIONS = [name for name, case in CONCURRENT_CASES.items() if case[0] == "completion"]


def batch_line(model: str, custom_id: str, name: str, **fields: Any) -> str:
    """The case `name` as a line of a batch's input file, greedy; `fields` join its body."""
    kind, asked, max_tokens = CONCURRENT_CASES[name]
    key, url = ("messages", "/v1/chat/completions") if kind == "chat" else (
        "prompt", "/v1/completions")  # fmt: skip
    body = {"model": model, key: asked, "max_tokens": max_tokens, "temperature": 0, **fields}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def entries(text: str) -> list[dict]:
    """A batch output or error file's entries."""
    return [json.loads(line) for line in text.splitlines()]
