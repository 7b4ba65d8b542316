"""The launcher's supervision of real processes: a lost replica is spared while another
serves, and leaves none of its children behind."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest
from conftest import wait_for

from prism.launcher import Mesh, Stage


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is still running (zombies aside)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def test_a_lost_replica_leaves_no_processes_behind():
    stage = Stage("worker-1", "", ["sh", "-c", "sleep 30 & exit 3"], lambda: True)
    spare = Stage("worker-0", "", ["sleep", "30"], lambda: True)
    mesh = Mesh([spare, stage])
    for s in mesh.stages:
        s.process = subprocess.Popen(s.argv, start_new_session=True)
    try:
        stage.process.wait()
        assert _group_alive(stage.process.pid), "the stage's child outlives it"
        mesh.check_alive(spare_replicas=True)
        assert wait_for(lambda: not _group_alive(stage.process.pid), timeout=5)
        assert spare.process.poll() is None
    finally:
        mesh.stop(grace=1)


def test_a_lost_replica_is_spared_while_another_serves():
    def stage(name: str, argv: list[str]) -> Stage:
        return Stage(name, "", argv, lambda: True)

    mesh = Mesh([stage("worker-0", ["sleep", "30"]), stage("worker-1", ["true"]),
                 stage("processor", ["sleep", "30"])])  # fmt: skip
    for s in mesh.stages:
        s.process = subprocess.Popen(s.argv)
    try:
        mesh.stages[1].process.wait()
        mesh.check_alive(spare_replicas=True)
        with pytest.raises(RuntimeError, match="worker-1"):
            mesh.check_alive()
        mesh.stages[0].process.kill()
        mesh.stages[0].process.wait()
        # The last replica of a stage is not spared.
        with pytest.raises(RuntimeError, match="worker"):
            mesh.check_alive(spare_replicas=True)
    finally:
        for s in mesh.stages:
            s.process.kill()
            s.process.wait()
