"""A mesh's greedy answers beside one offline vLLM engine's, token for token, on this machine.

The oracle the tests hold on the CPU, taken where tests do not run: on a GPU, with the
checkpoint's dtype and CUDA graphs. `oracle(model, n, max_tokens)` runs `vllm.LLM` in a
process of its own (`python -m bench.parity MODEL N MAX_TOKENS`), with the engine settings
Prism's workers use on this platform, one prompt at a time; `answers(address, ...)` asks a
mesh's public gRPC API (`prism.v1.InferenceService.Chat`) the same, one at a time, with
their log probabilities; `compare` says, per prompt, whether the token ids are equal and,
where they are not, the first position that differs and the margin (top-1 minus top-2 log
probability) each side had there: numerics may differ between batch shapes, and a near tie
is where they show.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import grpc
import numpy as np
from PIL import Image

from prism.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc

TOP = 5
# Image sizes of the prompts, in turn: each lays out a different number of tokens.
SIZES = ((64, 48), (112, 112), (224, 168), (336, 336))


def png(seed: int) -> bytes:
    width, height = SIZES[seed % len(SIZES)]
    pixels = (np.random.RandomState(1000 + seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def question(seed: int) -> str:
    return f"Prompt {seed}: describe this image in detail."


def oracle(model: str, n: int, max_tokens: int, eager: bool = False) -> list[dict]:
    """Each prompt's greedy token ids and, per position, the top log probabilities;
    `eager`: without compilation or CUDA graphs on a GPU too (as a mesh started with
    vLLM's `--enforce-eager`)."""
    command = [sys.executable, "-m", "bench.parity", model, str(n), str(max_tokens)]
    run = subprocess.run(
        command + (["eager"] if eager else []),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("ORACLE ")]
    if run.returncode != 0 or not lines:
        raise RuntimeError(f"the offline engine failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("ORACLE "))


def answers(address: str, model: str, n: int, max_tokens: int) -> list[dict]:
    """The mesh's answers to the same prompts, through its public gRPC API."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for seed in range(n):
            image = common_pb2.Image(data=png(seed), mime_type="image/png")
            content = [
                inference_pb2.ContentPart(image=image),
                inference_pb2.ContentPart(text=question(seed)),
            ]
            request = inference_pb2.ChatRequest(
                model=model,
                messages=[inference_pb2.ChatMessage(role=inference_pb2.ROLE_USER, content=content)],
                sampling=common_pb2.SamplingParams(
                    temperature=0, max_tokens=max_tokens, logprobs=TOP, ignore_eos=True
                ),
            )
            tokens: list[int] = []
            tops: list[dict[str, float]] = []
            for reply in stub.Chat(request, timeout=300):
                tokens += reply.token_ids
                tops += [{str(t.token_id): t.logprob for t in p.top} for p in reply.logprobs]
            out.append({"token_ids": tokens, "top": tops})
    return out


def margin(top: dict[str, float]) -> float:
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def compare(expected: list[dict], got: list[dict]) -> list[dict]:
    rows = []
    for want, have in zip(expected, got, strict=True):
        a, b = want["token_ids"], have["token_ids"]
        row: dict = {"equal": a == b, "tokens": len(a)}
        if a != b:
            pairs = zip(a, b, strict=False)
            at = next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
            row["first_difference"] = at
            if at < min(len(want["top"]), len(have["top"])):
                row["margin_offline"] = margin(want["top"][at])
                row["margin_mesh"] = margin(have["top"][at])
        rows.append(row)
    return rows


def _run_oracle(model: str, n: int, max_tokens: int, eager: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if cpu:
        # The model in this process, as Prism's CPU workers run it (prism.engine.launch):
        # no engine core and model process to start and spin between; the same answers.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # As Prism's workers run their engines (prism.engine.launch): float32 and eager
    # on the CPU backend; the checkpoint's dtype and CUDA graphs on a GPU.
    llm = LLM(
        model=model,
        dtype="float32" if cpu else "auto",
        enforce_eager=cpu or eager,
        limit_mm_per_prompt={"image": 8},
        seed=0,
    )
    results = []
    for seed in range(n):
        url = "data:image/png;base64," + base64.b64encode(png(seed)).decode()
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question(seed)},
                ],
            }
        ]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOP, ignore_eos=True)
        (output,) = llm.chat(messages, params, use_tqdm=False)
        completion = output.outputs[0]
        tops = [
            {str(token): entry.logprob for token, entry in position.items()}
            for position in completion.logprobs or []
        ]
        results.append({"token_ids": list(completion.token_ids), "top": tops})
    print("ORACLE " + json.dumps(results), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _run_oracle(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["eager"])
