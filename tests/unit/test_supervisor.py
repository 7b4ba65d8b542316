"""`prism serve`'s supervision and the bounded ends of processes (no processes started)."""

from __future__ import annotations

import os
import subprocess

import pytest

from prism.ops.stage_process import StageProcess
from prism.ops.supervisor import GaveUp, RestartPolicy, Supervisor
from prism.runtime import processes


class FakeProcess:
    """A stage's process: running until `exit` is called."""

    pid = 0

    def __init__(self) -> None:
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeMesh:
    def __init__(self) -> None:
        self.spawned: list[str] = []

    def spawn(self, stage: StageProcess, log: object = None) -> None:
        self.spawned.append(stage.name)
        stage.process = FakeProcess()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def supervised(monkeypatch):
    monkeypatch.setattr("prism.ops.supervisor.kill_group", lambda process: None)
    healthy = {"encoder-0": False}
    stage = StageProcess("encoder-0", "", [], lambda: healthy["encoder-0"])
    mesh, clock, reports = FakeMesh(), Clock(), []
    mesh.spawn(stage)
    mesh.spawned.clear()
    policy = RestartPolicy(limit=3, window_s=60, backoff_s=1, max_backoff_s=4)
    supervisor = Supervisor(mesh, [stage], policy, clock=clock, report=reports.append)
    return supervisor, stage, mesh, clock, reports, healthy


def test_a_stage_that_exits_is_started_again_after_its_backoff(supervised):
    supervisor, stage, mesh, clock, reports, healthy = supervised
    supervisor.poll()
    assert supervisor.down() == [] and mesh.spawned == []
    stage.process.returncode = -9
    supervisor.poll()
    assert reports[-1].startswith("encoder-0 exited (SIGKILL); restarting it in 1 s")
    assert supervisor.down() == ["encoder-0"]
    clock.now += 0.5
    supervisor.poll()
    assert mesh.spawned == []
    clock.now += 0.5
    supervisor.poll()
    assert mesh.spawned == ["encoder-0"]
    # Running again, but down until healthy.
    supervisor.poll()
    assert supervisor.down() == ["encoder-0"]
    healthy["encoder-0"] = True
    supervisor.poll()
    assert supervisor.down() == []
    assert reports[-1] == "encoder-0 is serving again"
    assert supervisor.restarts == 1


def test_backoff_doubles_with_recent_exits_and_the_mesh_gives_up_past_the_limit(supervised):
    supervisor, stage, _, clock, reports, _ = supervised
    delays = []
    for _ in range(3):
        stage.process.returncode = 1
        supervisor.poll()
        delays.append(reports[-1].split(" in ")[1].split(" s ")[0])
        clock.now += 10
        supervisor.poll()
    assert delays == ["1", "2", "4"]
    stage.process.returncode = 1
    with pytest.raises(GaveUp, match=r"encoder-0 exited \(code 1\) 4 times in 60 s"):
        supervisor.poll()


def test_exits_older_than_the_window_are_forgotten(supervised):
    supervisor, stage, _, clock, reports, _ = supervised
    for _ in range(10):
        stage.process.returncode = 3
        supervisor.poll()
        assert "restarting it in 1 s (1 of 3" in reports[-1]
        clock.now += 61
        supervisor.poll()
    assert supervisor.restarts == 10


def test_backoff_is_capped():
    policy = RestartPolicy(backoff_s=1, max_backoff_s=30)
    assert [policy.delay(n) for n in (1, 2, 3, 5, 6, 20)] == [1, 2, 4, 16, 30, 30]


def test_exit_reasons_read_as_people_say_them():
    assert processes.exit_reason(0) == "code 0"
    assert processes.exit_reason(3) == "code 3"
    assert processes.exit_reason(-15) == "SIGTERM"


class Unkillable:
    """A process that outlives SIGKILL until it runs at idle priority (as a stage stuck in
    the kernel did), or for good; records what happened to it."""

    pid = 0

    def __init__(self, ever: bool = True) -> None:
        self.ever = ever
        self.events: list[str] = []

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            raise AssertionError("waited without a deadline")
        if "idle" not in self.events or not self.ever:
            raise subprocess.TimeoutExpired("stage", timeout)
        self.events.append("reaped")
        return -9


def test_a_killed_stage_that_does_not_exit_is_made_idle_then_reaped(monkeypatch):
    stuck = Unkillable()
    monkeypatch.setattr(
        os, "sched_setscheduler", lambda pid, policy, param: stuck.events.append("idle")
    )
    assert processes.reap(stuck, patience=0.01)
    assert stuck.events == ["idle", "reaped"]


def test_a_process_that_never_goes_is_reported_and_left(monkeypatch, caplog):
    stuck = Unkillable(ever=False)
    stuck.pid = os.getpid()
    monkeypatch.setattr(os, "sched_setscheduler", lambda pid, policy, param: None)
    assert not processes.reap(stuck, patience=0.01, deadline=0.02)
    (record,) = caplog.records
    # Its pid, scheduler state and kernel wait channel.
    assert f"pid {os.getpid()} (" in record.getMessage()
    assert "state " in record.getMessage() and "wchan " in record.getMessage()


def test_describing_a_gone_process_says_so():
    assert processes.describe(2**22 + 1) == f"pid {2**22 + 1}: gone"


def test_a_stage_released_may_exit_and_one_watched_later_is_restarted(supervised):
    supervisor, stage, mesh, _, reports, _ = supervised
    supervisor.release(stage)  # the planner stops it
    stage.process.returncode = 0
    supervisor.poll()
    assert mesh.spawned == [] and reports == [] and supervisor.stages == []
    mesh.spawn(stage)  # the planner starts it again
    supervisor.watch(stage)
    stage.process.returncode = -9
    supervisor.poll()
    assert reports[-1].startswith("encoder-0 exited (SIGKILL)")
