"""The launcher's supervision of real processes: a stage that exits leaves none of its
children behind and is started again; stopping the mesh waits on nothing without end."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.waiting import wait_for

from prism.ops.launcher import Mesh
from prism.ops.stage_process import StageProcess
from prism.ops.supervisor import RestartPolicy, Supervisor


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies aside)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_a_stage_that_exits_leaves_no_processes_behind_and_is_started_again(tmp_path):
    started = tmp_path / "started"
    # The first time: a child that would outlive the stage, then exit 3; then it serves.
    script = (f"if [ -e {started} ]; then exec sleep 30; fi; touch {started}; "
              "sleep 30 & exit 3")  # fmt: skip
    stage = StageProcess("encoder-0", "", ["sh", "-c", script], lambda: True)
    other = StageProcess("processor", "", ["sleep", "30"], lambda: True)
    mesh = Mesh([stage, other])
    for each in mesh.stages:
        mesh.spawn(each)
    first = stage.process
    reports: list[str] = []
    supervisor = Supervisor(mesh, mesh.stages, RestartPolicy(backoff_s=0.1), report=reports.append)
    try:
        first.wait(timeout=10)
        assert _group_alive(first.pid), "the stage's child outlives it"

        def restarted() -> bool:
            supervisor.poll()
            return stage.process is not first and not supervisor.down()

        assert wait_for(restarted, timeout=10), reports
        assert not _group_alive(first.pid)
        assert stage.process.poll() is None and other.process.poll() is None
        assert reports == [
            "encoder-0 exited (code 3); restarting it in 0 s (1 of 5 restarts in 300 s)",
            "encoder-0 is serving again",
        ]
    finally:
        mesh.stop(grace=1)
    assert stage.process.poll() is not None and other.process.poll() is not None


def test_stopping_a_mesh_ends_a_stage_that_ignores_sigterm(tmp_path):
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(60)"]  # fmt: skip
    output = tmp_path / "gateway.log"
    # Healthy once it says so (the launcher names it on its line): from then on it ignores
    # SIGTERM.
    stage = StageProcess("gateway", "", stubborn, lambda: output.read_text() == "gateway | up\n")
    mesh = Mesh([stage])
    with output.open("w") as log:
        mesh.start(timeout=10, log=log)
    started = time.monotonic()
    mesh.stop(grace=1)
    assert stage.process.returncode == -9
    assert time.monotonic() - started < 20


def test_an_engine_starts_once_those_it_waits_for_serve_and_a_late_one_is_named_with_its_phase(
    tmp_path,
):
    served = tmp_path / "served"
    # Says what vLLM says when it loads weights, serves once its file exists.
    first = StageProcess(
        "prefill-0", "",
        # (a second after its start: the launcher reports its first phase meanwhile).
        [sys.executable, "-c", "import time; time.sleep(1); "
         f"print('INFO 11-28 17:11:27 [r.py:68] Starting to load model m...', flush=True); "
         f"time.sleep(3); open({str(served)!r}, 'w'); "
         "time.sleep(60)"],
        served.exists, log_level="WARNING",
    )  # fmt: skip
    # Imports at once, starts its engine once its gate opens, and never serves.
    engine = ("from prism.runtime import processes; import os; "
              "print('imported', os.path.exists(os.environ['PRISM_START_GATE']), flush=True); "
              "processes.wait_for_turn(0.05); print('its turn', flush=True); "
              "import time; time.sleep(60)")  # fmt: skip
    second = StageProcess(
        "decode-0", "", [sys.executable, "-c", engine], lambda: False, after=["prefill-0"]
    )
    mesh, reports = Mesh([first, second]), []
    output = tmp_path / "mesh.log"
    try:
        with output.open("w") as log, pytest.raises(TimeoutError) as raised:
            mesh.start(timeout=8, log=log, report=reports.append)
    finally:
        mesh.stop(grace=1)
    assert [r.split(" (")[0] for r in reports] == [
        "prefill-0: importing", "decode-0: importing, then waiting for prefill-0",
        "prefill-0: loading weights", "prefill-0: serving", "decode-0: starting the engine",
    ]  # fmt: skip
    message = str(raised.value)
    assert message.startswith(
        "stages not serving after 8 s (--start-timeout): decode-0 starting the engine for "
    )
    assert "prefill-0" not in message.split(":", 1)[1]
    # vLLM's INFO line made the phase, and was held back at the stage's level; the engine
    # imported before its gate opened, and started once it had.
    assert output.read_text() == "decode-0  | imported False\ndecode-0  | its turn\n"


def _running(pid: int) -> bool:
    """Whether `pid` is still running (a zombie is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_process_whose_parent_is_killed_ends_with_it():
    # vLLM's engine core, as a worker starts it: a child the launcher did not start.
    engine = ("from prism.runtime import processes; import time; "
              "processes.exit_with_parent(interval=0.05); print('ready', flush=True); "
              "time.sleep(60)")  # fmt: skip
    worker = ("import subprocess, sys, time; "
              f"child = subprocess.Popen([sys.executable, '-c', {engine!r}], "
              "stdout=subprocess.PIPE); "
              "child.stdout.readline(); print(child.pid, flush=True); time.sleep(60)")  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _running(child)
        parent.kill()
        parent.wait()
        assert wait_for(lambda: not _running(child), timeout=10)
    finally:
        parent.kill()
        parent.wait()
