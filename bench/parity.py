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
import tempfile
from pathlib import Path

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


# The video prompt, after the image prompts, for models with a video path.
VIDEO_QUESTION = "Describe this video in detail."


def mp4() -> bytes:
    """16 frames of noise at 8 fps, 64x48, MPEG-4 in MP4 (as the tests' videos)."""
    from prism.media.video import encode_video

    rng = np.random.RandomState(2000)
    frames = [(rng.rand(48, 64, 3) * 255).astype("uint8") for _ in range(16)]
    with tempfile.TemporaryDirectory() as directory:
        return encode_video(frames, 8.0, f"{directory}/video.mp4")


def has_video(model: str) -> bool:
    """Whether the model's family takes videos (Qwen2-VL and Qwen2.5-VL)."""
    config = json.loads(Path(model, "config.json").read_text())
    return config.get("model_type") in ("qwen2_vl", "qwen2_5_vl")


def oracle(model: str, n: int, max_tokens: int, eager: bool = False) -> list[dict]:
    """Each prompt's greedy token ids and, per position, the top log probabilities (`n`
    image prompts, then a video prompt where the model takes videos);
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
    """The mesh's answers to the same prompts (and the video prompt, where the model takes
    videos), streamed through its public gRPC API."""
    out = []
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        video = common_pb2.Video(data=mp4(), mime_type="video/mp4") if has_video(model) else None
        for seed in range(n + (video is not None)):
            if seed < n:
                media = inference_pb2.ContentPart(
                    image=common_pb2.Image(data=png(seed), mime_type="image/png")
                )
            else:
                media = inference_pb2.ContentPart(video=video)
            text = question(seed) if seed < n else VIDEO_QUESTION
            content = [media, inference_pb2.ContentPart(text=text)]
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
                # The offline engine's own top two were equal there: which of them greedy
                # takes is the kernels' rounding (bfloat16 on a GPU), not the mesh's doing.
                top = want["top"][at]
                row["tie"] = at < len(b) and top.get(str(b[at])) == max(top.values())
        rows.append(row)
    return rows


def _run_oracle(model: str, n: int, max_tokens: int, eager: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    video = has_video(model)
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
        limit_mm_per_prompt={"image": 8} | ({"video": 1} if video else {}),
        seed=0,
    )
    results = []
    for seed in range(n + video):
        if seed < n:
            url = "data:image/png;base64," + base64.b64encode(png(seed)).decode()
            media = {"type": "image_url", "image_url": {"url": url}}
        else:
            url = "data:video/mp4;base64," + base64.b64encode(mp4()).decode()
            media = {"type": "video_url", "video_url": {"url": url}}
        text = question(seed) if seed < n else VIDEO_QUESTION
        messages = [{"role": "user", "content": [media, {"type": "text", "text": text}]}]
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
