"""`prism model build` builds a tiny checkpoint from the command line."""

import subprocess
import sys


def test_cli_builds_a_model(tmp_path):
    out = tmp_path / "cli-llava"
    result = subprocess.run(
        [sys.executable, "-m", "prism.cli", "model", "build", "--family", "llava",
         "--out", str(out), "--seed", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
