"""The cases every mode must answer as offline vLLM does (`run_oracle`, oracle.py) and
as `vllm serve` does (parity.py), and asking a mesh for them."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from support.content import data_url, image_part, png, user, video, video_part

FAMILIES = ("llava", "qwen2-vl")
ORACLE = Path(__file__).parent / "oracle.py"


def laid_out(model: str, messages: list[dict], images: list[bytes]) -> tuple[list[int], list]:
    """A chat of text and images (`images`: their bytes, in order) as the processor lays it
    out for `kv` routing: the chat template's token ids, each image's placeholder expanded,
    and where each image lies (`kv_index.MediaSpan`)."""
    from transformers import AutoTokenizer

    from prism.kv_index import lay_out
    from prism.media.image import check_image
    from prism.media.policy import MediaPolicy
    from prism.media.prompt import PromptMedia
    from prism.services.processor.inputs import ModelInputs

    def parts(content: str | list[dict]) -> list[dict]:
        if isinstance(content, str):
            return [{"type": "text", "text": content}]
        return [p if p["type"] == "text" else {"type": "image"} for p in content]

    conversation = [{"role": m["role"], "content": parts(m["content"])} for m in messages]
    tokenizer = AutoTokenizer.from_pretrained(model)
    template = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(template, add_special_tokens=False)
    inputs = ModelInputs.of(model, enable_mm_embeds=False, count_tokens=True)
    media = PromptMedia([check_image(image, MediaPolicy(), "image") for image in images])
    return lay_out(prompt, inputs.placeholders, inputs.media_items(media))


# The parity cases: name -> (kind, messages or prompt, max_tokens). Oracle and mesh both
# see the same images as data URLs; tests may swap a data URL for an http URL of the same
# bytes.
CASES = {
    "one_image": ("chat", user(image_part(data_url(png(1))), "What is in this image?"), 16),
    "other_image": ("chat", user(image_part(data_url(png(2))), "What is in this image?"), 16),
    "three_images": (
        "chat",
        user(
            image_part(data_url(png(3))),
            "Compare",
            image_part(data_url(png(4))),
            "with",
            image_part(data_url(png(5))),
        ),
        16,
    ),
    "text_only": (
        "chat",
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Tell me about the river."},
        ],
        16,
    ),
    "completion": ("completion", "The quick brown fox", 16),
}

# Parity cases of the families with a video path (VIDEO_FAMILIES): videos as data URLs.
VIDEO_FAMILIES = ("qwen2-vl",)

VIDEO_CASES = {
    "video": ("chat", user(video_part(data_url(video(1), "video/mp4")), "What happens?"), 16),
    "image_and_video": (
        "chat",
        user(
            image_part(data_url(png(6))),
            "and",
            video_part(data_url(video(2, container="webm"), "video/webm")),
            "Compare them.",
        ),
        16,
    ),
    "two_videos": (
        "chat",
        user(
            video_part(data_url(video(3), "video/mp4")),
            "then",
            video_part(data_url(video(4, frames=24, fps=12.0), "video/mp4")),
            "What changed?",
        ),
        16,
    ),
}


def openai_client(mesh: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=mesh.base_url, api_key="unused", max_retries=0)


def ask_case(mesh: Any, case: tuple, stream: bool) -> tuple[str, Any]:
    """One parity case (kind, messages or prompt, max_tokens[, sampling parameters])
    through the OpenAI SDK, greedy unless the case says otherwise: the answer's text and
    usage."""
    kind, body, max_tokens, *sampling = case
    client = openai_client(mesh)
    params = {"temperature": 0, "max_tokens": max_tokens, **(sampling[0] if sampling else {})}
    if kind == "chat":
        kwargs = dict(model=mesh.model, messages=body, **params)
        if not stream:
            reply = client.chat.completions.create(**kwargs)
            return reply.choices[0].message.content, reply.usage
        options = {"include_usage": True}
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options=options))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return text, chunks[-1].usage
    kwargs = dict(model=mesh.model, prompt=body, **params)
    if not stream:
        reply = client.completions.create(**kwargs)
        return reply.choices[0].text, reply.usage
    options = {"include_usage": True}
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options=options))
    return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].usage


# Words of the concurrent prompts: prompts that differ by a number only ("item 7") get the
# same answer from a random-weight model too often for swapped answers to show.
_WORDS = (
    "apple", "river", "stone", "cloud", "garden", "window", "music", "paper", "silver",
    "forest", "candle", "bridge", "ocean", "winter", "market", "letter", "mountain", "coffee",
    "thunder", "needle", "castle", "pepper", "rabbit", "engine", "mirror", "harbor", "lemon",
    "planet", "violin", "meadow", "tunnel", "basket", "desert", "feather", "lantern",
    "orchard", "pillow", "saddle", "temple", "wagon", "yellow", "zebra", "anchor", "blanket",
    "cactus", "dragon",
)  # fmt: skip


def _concurrent_case(i: int) -> tuple:
    text = " ".join(random.Random(i).sample(_WORDS, 6))
    if i % 4 == 3:
        return ("completion", f"{text}:", 8)
    parts = [image_part(data_url(png(300 + i)))] if i % 2 else []
    return ("chat", user(*parts, f"{text}?"), 8)


# Sent all at once, 16 at a time (test_openai_sdk): each answer is its own and offline
# vLLM's, so that KV or embeddings crossing between concurrent requests show.
CONCURRENT_CASES = {f"concurrent_{i}": _concurrent_case(i) for i in range(64)}

# The first 16 again, sampled with a seed each: vLLM's answer to a seeded request is the
# same whatever else runs beside it.
SEEDED_CASES = {
    f"seeded_{i}": (*case, {"temperature": 1.0, "seed": 100 + i})
    for i, case in enumerate(list(CONCURRENT_CASES.values())[:16])
}


# The LoRA adapters every shared mesh serves beside its base model (fixtures.adapters), and
# image chats asked of the base and of each, all sent together too (test_lora): a case's
# adapter is its sampling's "lora" ("" for the base).
ADAPTERS = ("a1", "a2")
LORA_CASES = {
    f"lora_{adapter or 'base'}_{i}": (
        "chat", user(image_part(data_url(png(700 + i))), f"{' '.join(_WORDS[i::9])}?"), 8,
        {"lora": adapter},
    )
    for adapter in ("", *ADAPTERS)
    for i in range(6)
}  # fmt: skip


def assert_answers_differ(expected: dict[str, dict], names: Iterable[str] = CONCURRENT_CASES):
    """The expected answers to `names` differ, so that answers handed to the wrong requests
    would not equal theirs: at most one in 32 is the same as another's (a random-weight
    model's answers to different prompts may meet)."""
    texts = [expected[name]["text"] for name in names]
    same = [text for text, count in collections.Counter(texts).items() if count > 1]
    assert len(set(texts)) >= len(texts) - len(texts) // 32, same


def cases(family: str) -> dict[str, tuple]:
    """The parity cases of `family`."""
    return CASES | VIDEO_CASES if family in VIDEO_FAMILIES else CASES


def run_oracle(
    model: Path, tmp: Path, named: dict[str, tuple], adapters: dict[str, Path] | None = None
) -> dict[str, dict]:
    """Offline vLLM's answer to each case of `named`, with the LoRA `adapters` (by name)
    that cases name."""
    # A case may add sampling parameters: (kind, body, max_tokens, {"temperature": ...}).
    cases = [
        {"kind": kind, "max_tokens": max_tokens, **(sampling[0] if sampling else {})}
        | ({"messages": body} if kind == "chat" else {"prompt": body})
        for kind, body, max_tokens, *sampling in named.values()
    ]
    for case in cases:
        if case.get("lora"):
            case["lora_path"] = str((adapters or {})[case["lora"]])
    cases_path = tmp / "cases.json"
    cases_path.write_text(json.dumps(cases))
    result = subprocess.run(
        [sys.executable, str(ORACLE), str(model), str(cases_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("ORACLE ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"oracle failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return dict(zip(named, json.loads(lines[-1][len("ORACLE ") :]), strict=True))


def answer(mesh, case: str) -> tuple[str, int]:
    """Text and completion tokens of one parity case, greedy, as one JSON body."""
    kind, body, max_tokens = CASES[case]
    if kind == "chat":
        path, request = "chat/completions", {"messages": body}
    else:
        path, request = "completions", {"prompt": body}
    request |= {"model": mesh.model, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{mesh.base_url}/{path}", json=request, timeout=120)
    assert reply.status_code == 200, reply.text
    reply = reply.json()
    choice = reply["choices"][0]
    text = choice["message"]["content"] if kind == "chat" else choice["text"]
    return text, reply["usage"]["completion_tokens"]


def assert_equals_offline_vllm(mesh, expected: dict[str, dict]) -> None:
    for case in CASES:
        text, tokens = answer(mesh, case)
        assert (text, tokens) == (expected[case]["text"], len(expected[case]["token_ids"])), case
