"""A chat request's body read and checked, alone (no server): the front's typed models
(prism.gateway.openai.schemas, msgspec) beside `json.loads` alone and beside vLLM's
pydantic model of the same request, on the body `make bench-scale` sends (one 64x48 PNG
as a data URL, streamed). Prints microseconds a body, the median of `--repeats` timings.

    .venv/bin/python -m bench.parsing
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from collections.abc import Callable

from bench.lib.load import chat, image_url
from prism.gateway import bodies
from prism.gateway.openai import chat as chat_api
from prism.gateway.openai import schemas


def _vllm() -> Callable[[bytes], object] | None:
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:
        try:
            from vllm.entrypoints.openai.protocol import ChatCompletionRequest
        except ImportError:
            return None
    return ChatCompletionRequest.model_validate_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    parts = [{"type": "image_url", "image_url": {"url": image_url(1)}},
             {"type": "text", "text": "Question 1: what is in this image?"}]  # fmt: skip
    raw = json.dumps(chat("models/tiny-llava", parts, 32)).encode()
    kind = schemas.ChatCompletionRequest
    ways: dict[str, Callable[[], object]] = {
        "json.loads": lambda: json.loads(raw),
        "msgspec, typed": lambda: bodies.decode(raw, kind),
        "msgspec, typed, as ChatRequest": lambda: chat_api.chat_request(bodies.decode(raw, kind)),
    }
    vllm = _vllm()
    if vllm is not None:
        ways["pydantic (vLLM's ChatCompletionRequest)"] = lambda: vllm(raw)
    print(f"a body of {len(raw)} bytes")
    for name, way in ways.items():
        times = timeit.repeat(way, number=args.number, repeat=args.repeats)
        print(f"{name:42} {statistics.median(times) / args.number * 1e6:7.1f} µs")


if __name__ == "__main__":
    main()
