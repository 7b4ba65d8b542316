"""The GPU host's whole check (`scripts/gpu-host/lease.sh`) in its CPU form: eager parity
through the script's own steps, what does not fit cut and said to be, and nothing it
started left running, so that the script is known to work before a GPU is lent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]


def _lease(
    tmp_path: Path, models: dict[str, Path], name: str, **env: str
) -> tuple[subprocess.CompletedProcess, Path]:
    out, work, held = (tmp_path / name / part for part in ("out", "work", "models"))
    out.mkdir(parents=True)
    # The suite's tiny models, as a lease finds them carried with the bundle.
    for family in env["FAMILIES"].split():
        shutil.copytree(models[family], held / f"tiny-{family}")
    run = subprocess.run(
        ["scripts/gpu-host/lease.sh"], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "FORM": "cpu", "OUT": str(out), "WORK": str(work),
             "MODELS": str(held), **env},
    )  # fmt: skip
    with tarfile.open(out / "lease.tgz") as archive:
        assert "./steps.tsv" in archive.getnames()
    return run, work


def _steps(work: Path) -> dict[str, str]:
    rows = [line.split("\t") for line in (work / "steps.tsv").read_text().splitlines()]
    return {name: status for name, status, *_ in rows}


def test_the_lease_checks_parity_eagerly_and_leaves_nothing_running(tmp_path, models):
    before = {p.pid for p in psutil.process_iter()}
    run, work = _lease(
        tmp_path, models, "parity", STEPS="parity", FAMILIES="qwen2-vl", MODES="ep/d"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert _steps(work) == {"parity": "0"}
    result = json.loads((work / "parity" / "parity.json").read_text())
    assert result["eager"] and not result["cut"] and not result["failed"]
    (mode,) = result["models"]["qwen2-vl"]["modes"].values()
    # Four image prompts and one video prompt (Qwen2-VL has a video path).
    assert mode["equal"] and [row["equal"] for row in mode["rows"]] == [True] * 5
    assert "qwen2-vl ep/d: started in" in run.stdout
    # Every process of the step's session was gone by its end.
    models = str(tmp_path / "parity" / "models")
    left = [p for p in psutil.process_iter(["cmdline"])
            if p.pid not in before and models in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not left, [p.info["cmdline"] for p in left]


def test_what_the_budget_leaves_no_room_for_is_cut_and_said_to_be(tmp_path, models):
    run, work = _lease(tmp_path, models, "cut", BUDGET="20", FAMILIES="qwen2-vl")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert _steps(work) == {"parity": "cut", "start": "cut", "serve": "cut"}
    assert "cut parity (" in run.stdout and "cut serve (" in run.stdout
