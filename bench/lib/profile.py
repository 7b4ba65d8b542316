"""Where a server's processes spend CPU: py-spy flame graphs and CPU seconds."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import psutil


def record(pids: dict[str, int], directory: Path | None, prefix: str) -> list[subprocess.Popen]:
    """py-spy recorders, one per process, each writing `prefix`-<name>.svg in `directory`
    when stopped; none without a directory."""
    if directory is None:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).with_name("py-spy")
    return [
        subprocess.Popen([str(spy), "record", "--pid", str(pid), "--rate", "100",
                          "--nonblocking", "--output", str(directory / f"{prefix}-{name}.svg")],
                         stderr=subprocess.DEVNULL)
        for name, pid in pids.items()
    ]  # fmt: skip


def finish(recorders: list[subprocess.Popen], timeout: float) -> None:
    """SIGINT makes each recorder write its flame graph."""
    for recorder in recorders:
        recorder.send_signal(signal.SIGINT)
    for recorder in recorders:
        recorder.wait(timeout=timeout)


def tree_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds each process and its children have used so far."""
    out = {}
    for name, pid in pids.items():
        total = 0.0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = process.cpu_times()
                    total += times.user + times.system
        out[name] = total
    return out
