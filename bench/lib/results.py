"""The results files, the record of every benchmark that docs/benchmarks.md is rendered
from, and what each result says of its run."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

DIR = Path("bench/results")
# Each record on the page by name: the image and video loads of bench/serve.py, its
# --anchors run, and bench/scale.py's, routing.py's, choices.py's, vllm_bench.py's,
# planner.py's, batch.py's.
RECORDS = {
    "image": DIR / "latest.json",
    "video": DIR / "video.json",
    "audio": DIR / "audio.json",
    "lora": DIR / "lora.json",
    "anchors": DIR / "anchors.json",
    "scale": DIR / "scale.json",
    "routing": DIR / "routing.json",
    "choices": DIR / "choices.json",
    "vllm_bench": DIR / "vllm_bench.json",
    "planner": DIR / "planner.json",
    "planner_vllm": DIR / "planner-vllm.json",
    "planner_dynamo": DIR / "planner-dynamo.json",
    "batch": DIR / "batch.json",
}


def stamp() -> dict[str, str]:
    """When and on what a run ran."""
    return {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }


def save(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def records(root: Path = Path()) -> dict[str, dict[str, Any]]:
    """Every record that has been written, by name (paths under `root`)."""
    return {
        name: json.loads((root / path).read_text())
        for name, path in RECORDS.items()
        if (root / path).exists()
    }
