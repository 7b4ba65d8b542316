"""`make verify-gpu` in its CPU form: the script that verifies a GPU host runs every step
here too (the tiny Qwen2-VL, device cpu), so that it is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_verification_runs_in_its_cpu_form(tmp_path: Path) -> None:
    results, doc = tmp_path / "results", tmp_path / "gpu.md"
    doc.write_text("# Prism on GPUs\n\nKept as it was.\n")
    env = {**os.environ, "FORM": "cpu", "RESULTS": str(results), "DOC": str(doc),
           "MODEL": str(tmp_path / "tiny-qwen2-vl")}  # fmt: skip
    run = subprocess.run(
        ["scripts/verify_gpu.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    steps = [line.split("\t") for line in (results / "commands.tsv").read_text().splitlines()]
    assert [(name, status) for name, _, status, _ in steps] == [
        (name, "0") for name in ("smoke", "model", "serve", "encoder", "transfer")
    ]
    serve = json.loads((results / "serve.json").read_text())
    assert {row["server"] for row in serve["rows"]} == {"vllm_serve", "e/p/d"}
    assert {row["concurrency"] for row in serve["rows"]} == {1, 32}
    # Four image prompts and one video prompt.
    assert [row["equal"] for row in serve["parity"]["modes"]["e/p/d"]] == [True] * 5
    text = doc.read_text()
    # The device's section, with each figure's command; the rest of the document kept.
    assert text.startswith("# Prism on GPUs\n\nKept as it was.\n")
    assert "<!-- verify-gpu: CPU -->" in text and "bench.transfer --device cpu" in text
    for title in ("Smoke", "Parity", "Serving", "NIXL", "Encoder"):
        assert f"**{title}.**" in text
