"""bench/serve.py's sections, the first after the summary: the image load with its figures
and the link to its notes, then the video and audio loads."""

from __future__ import annotations

from typing import Any

from bench.lib.plots import FIGURES
from bench.lib.sections.common import notes_link, setting, table
from bench.lib.shapes import AUDIO_RATE, AUDIO_SECONDS, VIDEO_FPS, VIDEO_FRAMES


def loads_section(results: dict[str, dict[str, Any]]) -> list[str]:
    """The image load (with its figures and the link to its notes), then the video and
    audio loads, as lines."""
    lines = []
    if image := results.get("image"):
        lines += ["## Image load", "", setting(image, "one 64x48 image"), "", *table(image), ""]
        lines += [*(f"![{label}](benchmarks-{name}.png)" for _, label, name in FIGURES), ""]
        lines += [*notes_link("image.md"), ""]
    media = {
        "video": (
            f"one {VIDEO_FRAMES}-frame 64x48 MP4 video (MPEG-4, {VIDEO_FPS:g} frames a "
            "second, every frame taken by the model's video loader)"
        ),
        "audio": (
            f"one {AUDIO_SECONDS:g} s clip of noise (16-bit mono WAV at "
            f"{AUDIO_RATE // 1000} kHz, the model's rate) as an `input_audio` part"
        ),
        "lora": (
            "one 64x48 image (the base model and two random rank-8 LoRA adapters of it "
            "asked in turn, every server serving both: `--enable-lora --max-loras 2 "
            "--lora-modules`)"
        ),
    }
    for load, what in media.items():
        if result := results.get(load):
            title = "LoRA" if load == "lora" else load.capitalize()
            lines += [f"## {title} load", "", setting(result, what), "",
                      *table(result), "", *resent_lines(load, result["resent"])]  # fmt: skip
    return lines


def resent_lines(load: str, resent: list[dict]) -> list[str]:
    if not resent:
        return []
    item = {"video": "video", "audio": "clip"}[load]
    return [
        f"**A {item} sent again.** Each of {resent[0]['requests']} new {item}s sent twice, "
        f"one request at a time, each sending under its own question asked before the "
        f"{item} (so the second shares no prompt prefix with the first past the chat "
        "template's); time to first token, p50:",
        "",
        "| server | first sending, ms | sent again, ms |",
        "|---|---:|---:|",
        *(
            f"| {r['server']} | {r['ttft_ms_p50_first']:.1f} | {r['ttft_ms_p50_repeat']:.1f} |"
            for r in resent
        ),
        "",
    ]
