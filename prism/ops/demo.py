"""`make demo`: the mesh on the embedded default, one real multimodal chat, streamed.

Builds the tiny LLaVA if absent, starts `prism serve`, sends a chat with an image through
the official OpenAI SDK, prints the answer as it streams, and stops the mesh.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import PIL.Image
import PIL.ImageDraw

from prism.ops.stage_process import http_ok
from prism.runtime.ports import free_port


def demo_image() -> str:
    image = PIL.Image.new("RGB", (96, 64), (30, 90, 200))
    draw = PIL.ImageDraw.Draw(image)
    draw.ellipse((20, 10, 70, 55), fill=(250, 200, 0))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="models/tiny-llava")
    parser.add_argument("--mode", default="epd")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    model = Path(args.model)
    if not (model / "config.json").exists():
        from prism.devtools.tiny_models import build

        print(f"building tiny LLaVA in {model} ...", flush=True)
        build("llava", model)

    port = free_port()
    command = [sys.executable, "-m", "prism.cli", "--log-level", "warning", "serve",
               "--mode", args.mode, "--model", str(model), "--http-port", str(port)]  # fmt: skip
    log_path = Path(tempfile.gettempdir()) / "prism-demo.log"
    print("$ prism " + " ".join(command[3:]), flush=True)
    print(f"(stage logs: {log_path})", flush=True)
    log = open(log_path, "w")  # noqa: SIM115 - closed in the finally below
    mesh = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not http_ok(f"http://127.0.0.1:{port}/health"):
            if mesh.poll() is not None or time.monotonic() > deadline:
                print(f"the mesh did not come up; see {log_path}", file=sys.stderr)
                return 1
            time.sleep(0.5)

        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        question = "What is in this picture?"
        print(f"\nuser: [image] {question}\nassistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=str(model),
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": demo_image()}},
                        {"type": "text", "text": question},
                    ],
                }
            ],
            max_tokens=32,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
            elif chunk.usage:
                usage = chunk.usage
                print(f"\n\n[{usage.prompt_tokens} prompt + {usage.completion_tokens} "
                      "completion tokens; random weights, so the words mean nothing]")  # fmt: skip
        return 0
    finally:
        mesh.send_signal(signal.SIGTERM)
        mesh.wait(timeout=60)
        log.close()


if __name__ == "__main__":
    sys.exit(main())
