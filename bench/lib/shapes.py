"""The shape of what the benchmarks run, which their runs and the page rendered from their
results both read: the servers' names, which is compared with which, the fixed size of
each load. No heavy imports: the page's renderer runs in `make lint`."""

from __future__ import annotations

ANCHOR = "vllm_serve"
# `vllm serve` with the engine as Prism's workers run it on the CPU backend (the model
# inside the engine core process): the same engine on both sides, so the ratio to it is
# the mesh's own cost.
SAME_ENGINE = "vllm_serve_uni"
ANCHORS = (ANCHOR, SAME_ENGINE)
DYNAMO_AGG, DYNAMO_PD, DYNAMO_E_PD = "dynamo_agg", "dynamo_pd", "dynamo_e_pd"
# With --anchors: each Prism mode beside the anchors of its shape (NVIDIA Dynamo's and
# vLLM's own disaggregation), and the disaggregation tax, each split mode beside EPD on
# the same cores.
SHAPES = {"epd": (DYNAMO_AGG,), "e/pd": (DYNAMO_E_PD,), "ep/d": (DYNAMO_PD, "vllm_pd")}
TAX = {"e/p/d": ("epd",), "ep/d": ("epd",)}
# A short clip, every frame of which Qwen2-VL's loader takes (it samples 2 frames a second).
VIDEO_FRAMES, VIDEO_FPS = 16, 2.0
# A short clip of audio at Qwen2-Audio's own rate: no server resamples it (vLLM on the CPU
# has no resampler of its own).
AUDIO_SECONDS, AUDIO_RATE = 2.0, 16000
# bench/routing.py's conversations: words of each system prompt, question and answer.
SYSTEM_WORDS, QUESTION_WORDS, ANSWER_WORDS = 900, 40, 60


def slug(server: str) -> str:
    """A server's name in keys and file names: e/pd is e_pd, as epd is not e/p/d."""
    return server.replace("/", "_")
